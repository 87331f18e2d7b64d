"""Write the bytecode of what etarl imports (setup.sh): its own packages, and of torch, transformers,
vLLM and Ray the modules its processes load (vLLM's engine core included), by importing them once.
Compiling all of site-packages instead took 87 s on a 2-core machine, for some 27,000 files of which
etarl's processes load about one in five; where PYTHONDONTWRITEBYTECODE is set no process writes
them, so without this each one would compile torch again. A module that cannot be imported here
(vLLM without its wheel, a GPU-only one) is skipped: its processes compile it as they load it."""
from __future__ import annotations

import contextlib
import importlib
import os
import pkgutil
import sys
import tomllib
from pathlib import Path

sys.dont_write_bytecode = False
REPO = Path(__file__).resolve().parents[1]
# Loaded in the processes vLLM, Ray and torch.distributed start, not by importing etarl's modules.
OTHERS = ("vllm.v1.engine.core", "vllm.v1.worker.cpu_worker", "vllm.v1.worker.gpu_worker",
          "vllm.model_executor.models.qwen2", "vllm.model_executor.models.qwen2_moe",
          "vllm.model_executor.models.qwen3_moe", "vllm.v1.sample.sampler", "vllm.entrypoints.llm",
          "ray.job_submission", "ray.util.placement_group", "ray.dashboard.modules.job.job_head",
          "torch.distributed.fsdp", "torch.distributed.checkpoint", "safetensors.torch")


def etarl_packages() -> list[str]:
    """The top-level packages pyproject.toml installs ("buffer*" -> "buffer")."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    return [pattern.rstrip("*") for pattern in project["tool"]["setuptools"]["packages"]["find"]["include"]]


def main() -> None:
    sys.path.insert(0, str(REPO))
    packages = etarl_packages()
    names = [info.name for package in packages
             for info in pkgutil.walk_packages([str(REPO / package)], prefix=f"{package}.")
             if not info.name.endswith(".__main__")]  # a command, run on import
    skipped = []
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
        for name in [*packages, *names, *OTHERS]:  # (their import-time notices are not the set-up's output)
            try:
                importlib.import_module(name)
            except BaseException:  # noqa: BLE001 - whatever a module raises at import: compiled on use
                skipped.append(name)
    if skipped:
        print(f"[setup] not importable here (compiled when first used): {', '.join(skipped)}")


if __name__ == "__main__":
    main()
