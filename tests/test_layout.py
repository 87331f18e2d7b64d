"""The package import arrows of DESIGN.md: buffer <- rollout_workers, learner <- services."""
import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "buffer": {"torch", "ray", "rollout_workers", "learner", "services", "lm", "transformers", "vllm"},
    "lm": {"buffer", "rollout_workers", "learner", "services"},
    "rollout_workers": {"learner", "services"},
    "learner": {"rollout_workers", "services"},
}


def imported_roots(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_point_one_way(package):
    files = sorted((REPO / package).rglob("*.py"))
    assert files, f"package {package} has no modules"
    offenders = {
        str(f.relative_to(REPO)): sorted(imported_roots(f) & FORBIDDEN[package]) for f in files
    }
    offenders = {f: bad for f, bad in offenders.items() if bad}
    assert not offenders, f"{package} must not import {sorted(FORBIDDEN[package])}: {offenders}"


def test_layout_checker_sees_a_forbidden_import(tmp_path):
    bad = tmp_path / "m.py"
    bad.write_text("import torch\nfrom ray.util import metrics\n")
    assert imported_roots(bad) == {"torch", "ray"}
