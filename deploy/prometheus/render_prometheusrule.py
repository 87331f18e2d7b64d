"""Render deploy/prometheus/rules.yml as the PrometheusRule in deploy/k8s/prometheusrule.yaml.

    python deploy/prometheus/render_prometheusrule.py > deploy/k8s/prometheusrule.yaml

rules.yml is the one home of the rules; tests/deploy checks the committed PrometheusRule agrees.
"""
from __future__ import annotations

import sys
from pathlib import Path

import yaml

HEADER = (
    "# deploy/prometheus/rules.yml as a PrometheusRule for the Prometheus Operator. Generated:\n"
    "#   python deploy/prometheus/render_prometheusrule.py > deploy/k8s/prometheusrule.yaml\n"
)


def render(rules_path: Path = Path(__file__).with_name("rules.yml")) -> str:
    rules = yaml.safe_load(rules_path.read_text())
    doc = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "etarl", "labels": {"app.kubernetes.io/name": "etarl", "release": "prometheus"}},
        "spec": {"groups": rules["groups"]},
    }
    return HEADER + yaml.safe_dump(doc, sort_keys=False, width=120)


if __name__ == "__main__":
    sys.stdout.write(render())
