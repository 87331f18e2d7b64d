"""A real Prometheus server for the tests: Debian's `prometheus` binary on a free loopback port,
its own storage in a temporary folder, fast scrape and rule evaluation, and a small HTTP API client.
Tests that need it skip, saying why, where the binary is absent (scripts/setup.sh installs it)."""
from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from services.chaos import free_port

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy" / "prometheus" / "rules.yml"


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"`{name}` is not installed (Debian package `prometheus`; scripts/setup.sh installs it)")
    return path


class PrometheusServer:
    """`targets`: {job name: ["127.0.0.1:port", ...]}. Loads deploy/prometheus/rules.yml."""

    def __init__(self, workdir: Path, targets: dict[str, list[str]], interval_ms: int = 1000):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        workdir.mkdir(parents=True, exist_ok=True)
        config = {
            "global": {"scrape_interval": f"{interval_ms}ms", "evaluation_interval": f"{interval_ms}ms",
                       "scrape_timeout": f"{interval_ms}ms"},
            "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": addrs}]}
                               for job, addrs in targets.items()],
        }
        config_path = workdir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config))
        self.log_path = workdir / "prometheus.log"
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            [binary("prometheus"), f"--config.file={config_path}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--web.enable-lifecycle"],
            stdout=self._log, stderr=subprocess.STDOUT, cwd=workdir)
        self._wait_ready()

    def _wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.process.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"prometheus not ready after {timeout_s}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def api(self, path: str, **params) -> dict | list:
        url = f"{self.url}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=10) as resp:
            body = json.load(resp)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """Instant query -> [{"metric": {...}, "value": float}]."""
        data = self.api("query", query=expr)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": float(data["result"][1])}]
        return [{"metric": r["metric"], "value": float(r["value"][1])} for r in data["result"]]

    def wait_for(self, expr: str, predicate=lambda rows: bool(rows), timeout_s: float = 60.0) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        rows: list[dict] = []
        while time.monotonic() < deadline:
            rows = self.query(expr)
            if predicate(rows):
                return rows
            time.sleep(0.5)
        raise AssertionError(f"{expr!r} never satisfied the condition in {timeout_s}s; last result {rows}")

    def targets_up(self) -> dict[str, str]:
        return {t["labels"]["job"]: t["health"] for t in self.api("targets")["activeTargets"]}

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
