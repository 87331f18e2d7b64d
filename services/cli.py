"""The `etarl` command (console script `etarl = services.cli:run`: `main`, then a quick exit).

    etarl train [--config F] [--resume RUN_DIR] [key=value ...]   run (or continue) training
    etarl eval  [--config F] [--model DIR | --run RUN_DIR] [key=value ...]   held-out evaluation
    etarl plot  RUN_DIR                                           redraw a run's PNG plots
    etarl config [--config F] [key=value ...]                     print the resolved config (with the
                                                                  layout and defaults for this machine's GPUs)
    etarl plan  [--config F] [--raycluster M] [key=value ...]     the layout chosen and why, what each actor
                                                                  asks Ray for; does it fit
    etarl data check [FILE ...] [--config F] [key=value ...]      check prompt files against the model (no
                                                                  FILE: the config's train and held-out files)
    etarl buffer serve|keygen ...                                 the standalone buffer service

The same entry works as a `ray job submit` entrypoint: `ray job submit -- etarl train
ray.address=auto ...` joins the job's cluster instead of starting an embedded one.
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import logging
import os
import sys
import threading
import warnings
from pathlib import Path

EXIT_CONFIG_ERROR = 2


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", "-c", help="YAML config file (default: the embedded default)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dotted overrides, e.g. learner.lr=3e-5 buffer.gate.eta=4 run.steps=500")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="etarl", description="Asynchronous RL for LLMs with bounded staleness.")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="run (or resume) training")
    _add_config_args(train)
    train.add_argument("--resume", metavar="RUN_DIR",
                       help="continue the run in RUN_DIR from its latest checkpoint (its saved config "
                            "plus any overrides, e.g. run.steps=80 to extend it)")

    ev = sub.add_parser("eval", help="evaluate a policy on the held-out prompts (greedy accuracy, pass@k)")
    _add_config_args(ev)
    where = ev.add_mutually_exclusive_group()
    where.add_argument("--model", help="HF model folder (default: the config's model)")
    where.add_argument("--run", metavar="RUN_DIR", help="the policy of a run's latest checkpoint")

    plot = sub.add_parser("plot", help="redraw the PNG plots of a run from its metrics.jsonl")
    plot.add_argument("run_dir", metavar="RUN_DIR")

    show = sub.add_parser("config", help="print the resolved config as YAML")
    _add_config_args(show)

    plan = sub.add_parser("plan", help="print the placement plan as JSON (every role: count, resources per actor, "
                          "placement; the total) and check it against the cluster; exit 2 if it cannot fit")
    _add_config_args(plan)
    plan.add_argument("--raycluster", metavar="MANIFEST", help="check against the nodes a KubeRay RayCluster or "
                      "RayJob manifest declares (default: ray.address: the embedded cluster's declared resources, "
                      "or the running cluster)")

    data = sub.add_parser("data", help="prompt files: etarl data check [FILE ...] [key=value ...]")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    check = data_sub.add_parser(
        "check", help="the start-of-run prompt checks on each FILE, or on the config's train and held-out files "
        "(the run's model, chat template and context): rows, tokens per prompt (p50/p99/max), unusable rows with "
        "their row numbers; exit 1 if a run would refuse one")
    check.add_argument("--config", "-c", help="YAML config file (default: the embedded default)")
    check.add_argument("items", nargs="*", metavar="FILE | key=value",
                       help="prompt files (.jsonl, .json or .parquet: etarl's flat form or verl's layout) and "
                       "dotted overrides, e.g. run.model=/models/x rollout.engine.max_model_len=1536")

    buf = sub.add_parser("buffer", help="the standalone buffer service: serve | keygen")
    buf.add_argument("buffer_args", nargs=argparse.REMAINDER, help="arguments of `python -m buffer`")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `buffer` hands its arguments over untouched (they have their own --help and flags).
    if argv[:1] == ["buffer"]:
        from buffer.server import main as buffer_main

        return buffer_main(argv[1:]) or 0
    args = build_parser().parse_args(argv)
    from services.config import ConfigError

    try:
        return _dispatch(args)
    except ConfigError as exc:
        print(f"etarl: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except FileNotFoundError as exc:
        print(f"etarl: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR


def _dispatch(args) -> int:
    from services.config import load_config

    if args.command == "plot":
        from services.plots import plot_run

        for path in plot_run(args.run_dir):
            print(path)
        return 0
    if args.command == "config":
        from services.placement import config_with_layout

        print(config_with_layout(load_config(args.config, args.overrides)), end="")
        return 0
    if args.command == "plan":
        from services.placement import plan_report

        report, problems = plan_report(load_config(args.config, args.overrides), args.raycluster)
        print(json.dumps(report, indent=1))
        if problems:
            print("etarl: the run does not fit the cluster:\n  " + "\n  ".join(problems), file=sys.stderr)
            return EXIT_CONFIG_ERROR
        return 0
    if args.command == "train":
        from services.controller import resume_config, run_training

        if args.resume:
            cfg = resume_config(args.resume, args.config, args.overrides)
        else:
            cfg = load_config(args.config, args.overrides)
        result = run_training(cfg, resume=args.resume)
        print(json.dumps(result.summary(), indent=1))
        if (result.run_dir / "plots").is_dir():  # not when a Ctrl-C ended the start
            print(f"plots: {result.run_dir / 'plots'}/*.png   metrics: {result.run_dir / 'metrics.jsonl'}")
        return 0 if result.completed or result.interrupted else 1
    if args.command == "eval":
        return _evaluate(args)
    if args.command == "data":
        return _data_check(args)
    raise AssertionError(args.command)


def _evaluate(args) -> int:
    from services.config import load_config
    from services.controller import evaluate_model
    from services.placement import QUIET_VLLM

    _quiet_engine(QUIET_VLLM)
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # its weight-loading bar, here on the console
    if args.run and not args.config:  # a run is evaluated on its own task and settings
        from services.controller import engine_for_this_machine, resume_config

        cfg = resume_config(args.run, None, args.overrides)
        cfg = engine_for_this_machine(cfg, {o.partition("=")[0] for o in args.overrides})
    else:
        cfg = load_config(args.config, args.overrides)
    with _etarl_lines_on_stderr():
        metrics = evaluate_model(cfg, model=args.model, run_dir=args.run)
    print(json.dumps(metrics, indent=1))  # stdout is the metrics' JSON alone
    return 0


def _quiet_engine(level: str) -> None:
    """The engine runs in this process and the engine-core process vLLM spawns: their warnings would
    bury what `etarl eval` says. vLLM's logging level (its own, once it configures logging; before
    that, its imports', here), its imports' deprecation warnings (here, and through the environment
    in the spawned process) and torch's C++ notices there (CPU thread binding)."""
    os.environ["VLLM_LOGGING_LEVEL"] = level
    logging.getLogger("vllm").setLevel(level)
    warnings.filterwarnings("ignore", category=FutureWarning, module="vllm")
    deprecations = "ignore::FutureWarning:vllm.triton_utils.dispatcher"  # torch.distributed.reduce_op, twice
    os.environ["PYTHONWARNINGS"] = ",".join(filter(None, (os.environ.get("PYTHONWARNINGS"), deprecations)))
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


@contextlib.contextmanager
def _etarl_lines_on_stderr():
    """etarl's INFO lines (what `etarl eval` evaluates, on which engine) on stderr for the block: through a
    handler on etarl's logger where no handler would show them (one on the root would print vLLM's warnings
    a second time), else through the handlers there are."""
    etarl_log = logging.getLogger("etarl")
    handler = None if etarl_log.hasHandlers() else logging.StreamHandler(sys.stderr)
    level = etarl_log.level
    if handler is not None:
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        etarl_log.addHandler(handler)
    etarl_log.setLevel(logging.INFO)
    try:
        yield
    finally:
        if handler is not None:
            etarl_log.removeHandler(handler)
        etarl_log.setLevel(level)


def _is_override(item: str) -> bool:
    key, sep, _ = item.partition("=")
    return bool(sep) and "/" not in key and not Path(item).exists()


def _data_check(args) -> int:
    from services.config import load_config
    from services.controller import resolve_model
    from services.inputs import data_check

    # An item is an override when it reads as one (dotted.key=value) and names no file here.
    overrides = [i for i in args.items if _is_override(i)]
    files = [i for i in args.items if not _is_override(i)]
    cfg = load_config(args.config, overrides)
    report, accepted = data_check(cfg, resolve_model(cfg), files)
    print(report)
    return 0 if accepted else 1


def run() -> None:
    """The `etarl` command: `main`, then the process ends the way an exit does but without
    Python's final collection of every object of torch, transformers and Ray (2-3 s after each
    command's last line): non-daemon threads are joined and the atexit handlers run (Ray's
    shutdown, logging's flush), then the process exits. An exception propagates as usual."""
    code = main()
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # CPython's own exit sequence, which os._exit skips
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
