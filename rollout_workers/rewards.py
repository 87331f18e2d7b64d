"""Reward functions and the runner that calls them safely.

Three forms are accepted, told apart by their signature:
  fn(response, answer) -> float                                   etarl's form
  compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict
                                                                  verl's form, called by keyword
  compute_score(data_sources, solution_strs, ground_truths, extra_infos) -> list[float | dict]
                                                                  verl's batch form (its
                                                                  BatchRewardManager): one call a group
A dict's "score" is the reward and its other numeric entries become metrics `reward/<key>`
(averaged over a step's samples). Any form may be `async` (awaited). Built-ins are named
("math", "exact", "gsm8k", "verl": verl's default reward, see verl_rewards); any other is
"package.module:function" or "path/to/file.py:function" (verl's `custom_reward_function.path`). A
module that is not an installed package travels to the workers in the Ray job's runtime environment
(`reward_py_modules`); a file reward is loaded from its path, else, on a node without that path, as
the module of the same name shipped that way.
`RewardRunner` calls the function in a child process with a per-response timeout (a batch call
has its responses' timeouts and CPU seconds together): a reward that
hangs, crashes, kills its process or returns a non-number is scored `failure_reward`, counted,
and the child is replaced, so the worker never stalls. The child sees only an allow-listed
environment (no keys or tokens of the worker's), answers in plain data (msgpack, never a pickle)
and runs under a CPU-time and a memory limit; one over them fails its response the same way.
"""
from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import json
import math
import numbers
import os
import re
import site
import sys
import sysconfig
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any, NamedTuple

from rollout_workers.child_process import (BadChildReply, ChildLimits, ChildProcess, ChildStartFailed,
                                          is_finite_number, serve)
from rollout_workers.data.problems import Problem
from rollout_workers.verl_rewards import gsm8k_reward, verl_default_reward
from rollout_workers.verl_stand_in import verl_import_hint, verl_stand_in

PLAIN_FORM = "fn(response, answer) -> float"
VERL_FORM = "compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict"
VERL_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")
VERL_BATCH_FORM = "compute_score(data_sources, solution_strs, ground_truths, extra_infos) -> list[float | dict]"
VERL_BATCH_ARGS = ("data_sources", "solution_strs", "ground_truths", "extra_infos")
DEFAULT_CPU_S = 10.0  # CPU seconds per response: a reward's threads and runaway code, past the wall timeout
DEFAULT_MEMORY_MB = 4096  # address space of the reward process (the interpreter and torch take ~0.7 GB)
MAX_REWARD_METRICS = 16  # metrics a reward may add per sample (they ride in the sample's metadata)
# the reward itself, the learner's reward/mean and reward/std, and the step's reward/failure_fraction
_RESERVED_METRICS = ("score", "mean", "std", "failure_fraction")
REWARD_ERROR = "reward_error"  # a sample's metadata: why its reward failed (it scored failure_reward)
ERROR_CHARS = 200  # of the message a sample carries about its failure (the buffer bounds a sample's strings)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_MARKED = re.compile(r"(?:####|answer is|answer:)\s*([^\n]*)", re.IGNORECASE)


def parse_number(text: str) -> Fraction | None:
    """'1,234' -> 1234, '-3/4' -> -3/4, '2.50' -> 5/2; None when it is not a number."""
    try:
        return Fraction(text.replace(",", "").strip())
    except (ValueError, ZeroDivisionError):
        return None


def extract_final_answer(response: str) -> str | None:
    """The final answer in a response: the last \\boxed{...}, else what follows the last
    '####' / 'answer is' / 'answer:', else the last number in the text."""
    for pattern in (_BOXED, _MARKED):
        found = pattern.findall(response)
        if found:
            numbers = _NUMBER.findall(found[-1])
            return numbers[0] if numbers else found[-1].strip()
    numbers = _NUMBER.findall(response)
    return numbers[-1] if numbers else None


def math_reward(response: str, answer: str) -> float:
    """1.0 when the response's final answer equals the reference as a number (exactly, so
    '0.50' == '1/2'), or as text when the reference is not a number; else 0.0."""
    expected = parse_number(answer)
    if expected is None:
        return exact_match_reward(response, answer)
    final = extract_final_answer(response)
    got = None if final is None else parse_number(final)
    return float(got is not None and got == expected)


def exact_match_reward(response: str, answer: str) -> float:
    return float(response.strip() == answer.strip())


BUILTIN_REWARDS: dict[str, Callable] = {"math": math_reward, "exact": exact_match_reward, "gsm8k": gsm8k_reward,
                                        "verl": verl_default_reward}


def is_file_spec(module_part: str) -> bool:
    """Whether the module part of a spec names a file (path/to/file.py) rather than a module."""
    return module_part.endswith(".py") or "/" in module_part or os.sep in module_part


def _load_file_module(path: Path, spec: str, kind: str = "reward"):
    """The module of a reward (or environment) file, loaded from the file (registered as
    etarl_<kind>_<stem>), or, where the file is not on this node, the module <stem> shipped in the job's py_modules."""
    if not path.is_file():
        try:
            return importlib.import_module(path.stem)
        except ImportError:
            raise ValueError(f"{kind} {spec!r}: file {str(path)!r} does not exist") from None
    name = f"etarl_{kind.replace(' ', '_')}_{path.stem}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # the file's own pickling and dataclasses need it registered
    try:
        module_spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        why = f"{type(err).__name__}: {err}"
        raise ValueError(f"{kind} {spec!r}: loading {str(path)!r} failed: {why}{verl_import_hint(why)}") from None
    return module


def load_module(module_name: str, spec: str, kind: str = "reward"):
    """The module of a spec: a file path (loaded from the file) or an importable module name;
    ValueError says why it cannot be had."""
    with verl_stand_in():  # a file written for verl imports verl's reward_score helpers
        return _import_module(module_name, spec, kind)


def _import_module(module_name: str, spec: str, kind: str):
    if is_file_spec(module_name):
        return _load_file_module(Path(module_name).expanduser(), spec, kind)
    try:
        return importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"{kind} {spec!r}: cannot import module {module_name!r} ({err}){verl_import_hint(str(err))}") \
            from None
    except Exception as err:  # the module's own code failed (a missing key, a syntax error)
        raise ValueError(f"{kind} {spec!r}: importing {module_name!r} failed: {type(err).__name__}: {err}") from None


def resolve_named(spec: str, builtins: dict[str, Any], kind: str = "reward", thing: str = "function") -> Any:
    """What a spec names: a built-in, "module:attribute" or "path/file.py:attribute" (rewards'
    convention, shared by environments); errors say what is wrong with the spec."""
    if spec in builtins:
        return builtins[spec]
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{kind} {spec!r} is neither a built-in ({sorted(builtins)}), 'module:{thing}' "
                         f"nor 'path/to/file.py:{thing}'")
    module = load_module(module_name, spec, kind)
    found = getattr(module, attr, None)
    if not callable(found):
        raise ValueError(f"{kind} {spec!r}: module {module_name!r} has no callable {attr!r}")
    return found


def resolve_reward(spec: str) -> Callable:
    """The function a reward spec names: a built-in, "module:function" or "path/file.py:function"."""
    return resolve_named(spec, BUILTIN_REWARDS, "reward")


def _call_style(fn: Callable, spec: str, filled: Any = ()) -> tuple[str, ...] | None:
    """How to call a reward: None for etarl's fn(response, answer), else the verl keywords it takes
    (VERL_ARGS' or, for the batch form, VERL_BATCH_ARGS'). Parameters named in `filled`
    (rollout.reward_kwargs) need nothing else. A signature that fits no form is a ValueError that
    shows all three."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # no signature to read (some C functions): assume etarl's form
        return None
    names = {p.name for p in params}
    var_keyword = any(p.kind is p.VAR_KEYWORD for p in params)
    required = [p.name for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                and p.name not in filled]
    if {"solution_strs", "ground_truths"} <= names or {"solution_str", "ground_truth"} <= names:
        keywords = VERL_BATCH_ARGS if "solution_strs" in names else VERL_ARGS
        passed = tuple(name for name in keywords if name in names or var_keyword)
        if set(required) <= set(passed):
            return passed
    else:
        positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        takes_two = len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in params)
        if takes_two and set(required) <= set(positional[:2]):
            return None
    shown = f"{getattr(fn, '__name__', 'function')}{inspect.signature(fn)}"
    raise ValueError(f"reward {spec!r}: {shown} fits no accepted form:\n  {PLAIN_FORM}   (etarl)\n"
                     f"  {VERL_FORM}   (verl; a dict's 'score' is the reward, its other numbers metrics)\n"
                     f"  {VERL_BATCH_FORM}   (verl's batch form: a score per response)")


class Scored(NamedTuple):
    """A reward and the metrics that came with it ({"reward/<key>": value}); `error` says why the
    reward failed ("" when it did not; then `value` is the runner's failure_reward)."""

    value: float
    metrics: dict[str, float]
    error: str = ""


class BadRewardValue(ValueError):
    """A reward returned something that is not a finite number (or a dict holding one as 'score')."""


def to_scored(value: Any) -> Scored:
    """A reward function's return value as a Scored; BadRewardValue says what is wrong with it."""
    if isinstance(value, dict):
        if not is_finite_number(value.get("score")):
            raise BadRewardValue(f"returned a dict whose 'score' is {value.get('score')!r}, not a finite number")
        metrics = {f"reward/{key}": float(v) for key, v in value.items()
                   if isinstance(key, str) and key not in _RESERVED_METRICS
                   and isinstance(v, numbers.Real) and math.isfinite(v)}
        return Scored(float(value["score"]), dict(list(metrics.items())[:MAX_REWARD_METRICS]))
    if not is_finite_number(value):
        raise BadRewardValue(f"returned {value!r:.200}, not a finite number")
    return Scored(float(value), {})


class Reward:
    """A reward spec loaded and called the same way whatever its form: `reward.score(responses,
    problems)` -> a Scored or a BadRewardValue per response, with `kwargs` besides (verl's
    reward_kwargs). One call of a batch-form function scores them all; the others are called once
    a response. An async reward is awaited on this object's own event loop."""

    def __init__(self, spec: str, kwargs: dict | None = None) -> None:
        self.spec = spec
        self.fn = resolve_reward(spec)
        self.kwargs = dict(kwargs or {})
        self.verl_args = _call_style(self.fn, spec, self.kwargs)
        self.batch = self.verl_args is not None and "solution_strs" in self.verl_args  # one call a group
        if self.kwargs:  # a call the function cannot take fails here, at start, not on every response
            self._check_call(spec)
        self._loop: asyncio.AbstractEventLoop | None = None

    def _check_call(self, spec: str) -> None:
        try:
            signature = inspect.signature(self.fn)
        except (TypeError, ValueError):  # no signature to read: the call will say
            return
        nothing = Problem("", "")
        args, keywords = self._arguments([""], [nothing]) if self.batch else self._arguments("", nothing)
        try:
            signature.bind(*args, **keywords)
        except TypeError as err:
            raise ValueError(f"reward {spec!r} cannot take rollout.reward_kwargs {sorted(self.kwargs)}: {err}") \
                from None

    def _arguments(self, response, problem) -> tuple[tuple, dict]:
        """(positional, keyword) arguments of a call (of lists, for the batch form); reward_kwargs win
        over verl's keywords, as in verl."""
        if self.verl_args is None:
            return (response, problem.answer_text), self.kwargs
        if self.batch:
            given = {"data_sources": [p.data_source for p in problem], "solution_strs": list(response),
                     "ground_truths": [p.answer for p in problem], "extra_infos": [_extra(p) for p in problem]}
        else:
            given = {"data_source": problem.data_source, "solution_str": response,
                     "ground_truth": problem.answer, "extra_info": _extra(problem)}
        return (), {**{name: given[name] for name in self.verl_args}, **self.kwargs}

    @property
    def form(self) -> str:
        return "etarl" if self.verl_args is None else "verl batch" if self.batch else "verl"

    def _call(self, response, problem) -> Any:
        args, kwargs = self._arguments(response, problem)
        with verl_stand_in():  # verl's rewards import their rules when called
            result = self.fn(*args, **kwargs)
            if inspect.isawaitable(result):
                if self._loop is None:
                    self._loop = asyncio.new_event_loop()
                result = self._loop.run_until_complete(result)
        return result

    def __call__(self, response: str, problem: Problem) -> Scored:
        """One response scored (by a call of one, for the batch form)."""
        scored = self.score([response], [problem])[0]
        if isinstance(scored, BadRewardValue):
            raise scored
        return scored

    def score(self, responses: list[str], problems: list[Problem]) -> list[Scored | BadRewardValue]:
        """A Scored per response, or the BadRewardValue that says what is wrong with its value. An
        exception of the function itself, or a batch answer that is not one value per response,
        raises (it fails every response of the call)."""
        if not self.batch:
            return [_scored_or_bad(lambda: self._call(r, p)) for r, p in zip(responses, problems, strict=True)]
        values = self._call(responses, problems)
        if hasattr(values, "tolist") and not isinstance(values, (list, tuple)):  # a numpy array or tensor
            values = values.tolist()
        if not isinstance(values, (list, tuple)) or len(values) != len(responses):
            count = f"{len(values)} values" if isinstance(values, (list, tuple)) else f"{values!r:.100}"
            raise BadRewardValue(f"returned {count} for {len(responses)} responses, not a value per response")
        return [_scored_or_bad(lambda v=v: v) for v in values]


def _extra(problem: Problem) -> dict:
    """A problem's extra_info as a verl reward gets it: a dict always (verl's managers give {} for a
    row without one, and add keys to it), a copy (a reward may change it)."""
    return dict(problem.extra_info) if isinstance(problem.extra_info, dict) else {}


def _scored_or_bad(value: Callable[[], Any]) -> Scored | BadRewardValue:
    """to_scored of what `value()` gives; a value that is no reward is returned as its BadRewardValue."""
    try:
        return to_scored(value())
    except BadRewardValue as err:
        return err


def reward_metrics(groups) -> dict[str, float]:
    """The mean of every `reward/<key>` metric the samples of `groups` carry (a step's record), and
    `reward/failure_fraction`: the share of samples whose reward failed."""
    sums: dict[str, list[float]] = {}
    samples = [sample for group in groups for sample in group.samples]
    for sample in samples:
        for key, value in sample.metadata.items():
            if key.startswith("reward/"):
                sums.setdefault(key, []).append(float(value))
    out = {key: sum(values) / len(values) for key, values in sorted(sums.items())}
    if samples:
        out["reward/failure_fraction"] = sum(REWARD_ERROR in s.metadata for s in samples) / len(samples)
    return out


def _installed_roots() -> list[Path]:
    """Where installed code lives (site-packages, the standard library) and etarl's own tree: a
    module there is already on every worker."""
    paths = sysconfig.get_paths()
    roots = [paths["purelib"], paths["platlib"], paths["stdlib"], *site.getsitepackages(), site.getusersitepackages()]
    return [Path(r).resolve() for r in roots] + [Path(__file__).resolve().parents[1]]


def reward_py_modules(spec: str) -> list[str]:
    """Local paths the workers need to import a reward: its file, or the top-level package (or
    module file) of a "module:function" that is not installed. Call where the spec resolves."""
    module_name, _, _ = spec.rpartition(":")
    if spec in BUILTIN_REWARDS or not module_name:
        return []
    return module_py_modules(module_name)


def module_py_modules(module_name: str) -> list[str]:
    """Local paths the workers need to import a module or file (a reward's, an environment's, a
    tool's): the file, or the top-level package (or module file) where it is not installed."""
    if is_file_spec(module_name):
        return [str(Path(module_name).expanduser().resolve())]
    root = importlib.import_module(module_name.split(".")[0])
    if getattr(root, "__file__", None):
        where = Path(root.__file__).resolve()
        where = where.parent if hasattr(root, "__path__") else where
    elif list(root.__path__):  # a namespace package
        where = Path(next(iter(root.__path__))).resolve()
    else:  # a module made in memory (etarl's stand-in of verl): nothing to ship
        return []
    if any(where.is_relative_to(installed) for installed in _installed_roots()):
        return []
    return [str(where)]


def _reward_handler():
    """The reward process's handler: (responses, problems) -> ("ok", [["ok", (value, metrics)] |
    ["bad", why] per response]) | ("bad" | "error", why) for the whole call. A request holds one
    response, or a group for a batch-form reward. Started as `python -m rollout_workers.rewards SPEC
    [KWARGS_JSON]`."""
    reward = Reward(sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else None)

    def handle(message):
        responses, problems = message
        try:
            results = reward.score(responses, problems)
        except BadRewardValue as err:
            return "bad", str(err)
        except Exception as err:  # the reward's own bug: report it, keep serving
            return "error", f"{type(err).__name__}: {err}"
        # plain data: this module is __main__ here
        return "ok", [["bad", str(r)] if isinstance(r, BadRewardValue) else ["ok", [r.value, r.metrics]]
                      for r in results]

    return handle


def _request_units(message) -> int:
    """Responses in a request: its CPU-time budget is that many times reward_cpu_s."""
    return len(message[0])


def _checked_reply(value: Any) -> Scored:
    """An "ok" reply of the reward process as a Scored: the child runs user code, so its reply is
    checked again here (a finite reward, at most MAX_REWARD_METRICS finite metrics)."""
    if not (isinstance(value, list) and len(value) == 2 and is_finite_number(value[0])
            and isinstance(value[1], dict) and len(value[1]) <= MAX_REWARD_METRICS
            and all(isinstance(k, str) and is_finite_number(v) for k, v in value[1].items())):
        raise BadRewardValue(f"answered {value!r:.120}, not (reward, metrics)")
    return Scored(float(value[0]), {k: float(v) for k, v in value[1].items()})


class RewardRunner:
    """Scores responses in a child process (`rollout_workers.child_process`), one response at a
    time, each within timeout_s, cpu_s CPU seconds and memory_mb of address space (None: no
    limit); a batch-form reward a group at a time, within its responses' seconds together."""

    def __init__(
        self, spec: str = "math", timeout_s: float = 5.0, failure_reward: float = 0.0, start_timeout_s: float = 60.0,
        cpu_s: float | None = DEFAULT_CPU_S, memory_mb: int | None = DEFAULT_MEMORY_MB, kwargs: dict | None = None,
        env_names: tuple[str, ...] = (),
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"reward timeout_s must be > 0, got {timeout_s}")
        if (cpu_s is not None and cpu_s <= 0) or (memory_mb is not None and memory_mb <= 0):
            raise ValueError(f"reward cpu_s and memory_mb must be > 0 (or None: no limit), got {cpu_s}, {memory_mb}")
        self.batch = Reward(spec, kwargs).batch  # fail fast, in the caller, on a bad spec, signature or keyword
        self.spec = spec
        self.timeout_s = timeout_s
        self.failure_reward = failure_reward
        self.calls_total = 0
        self.failures_total = 0
        self.timeouts_total = 0
        self.last_error = ""
        # Starting Python is slow on a loaded machine: start_timeout_s is apart from the reward timeout.
        self.limits = ChildLimits(cpu_s, memory_mb)
        self._child = ChildProcess("rollout_workers.rewards", [spec] + ([json.dumps(kwargs)] if kwargs else []),
                                   start_timeout_s, self.limits, tuple(env_names))

    @classmethod
    def for_rollout(cls, rollout) -> "RewardRunner":
        """The runner of a RolloutConfig's reward: its spec, keyword arguments, limits and variables."""
        return cls(rollout.reward, timeout_s=rollout.reward_timeout_s, cpu_s=rollout.reward_cpu_s,
                   memory_mb=rollout.reward_memory_mb, kwargs=rollout.reward_kwargs,
                   env_names=tuple(rollout.reward_env))

    def _fail(self, why: str) -> Scored:
        self.failures_total += 1
        self.last_error = why
        return Scored(self.failure_reward, {}, why)

    def score_one(self, response: str, problem: Problem) -> Scored:
        return self._score_call([response], problem)[0]

    def score(self, responses: list[str], problem: Problem) -> list[Scored]:
        """A Scored per response to `problem`: one call for a batch-form reward, else one a response."""
        if self.batch:
            return self._score_call(responses, problem)
        return [self.score_one(response, problem) for response in responses]

    def _score_call(self, responses: list[str], problem: Problem) -> list[Scored]:
        """One request to the reward process; every way it can fail scores its responses failure_reward."""
        if not responses:
            return []
        n = len(responses)
        self.calls_total += n
        timeout_s = self.timeout_s * n
        try:
            self._child.ensure_started()
            self._child.send((responses, [problem] * n), units=n)
            reply = self._child.reply(timeout_s)
        except TimeoutError:  # (an OSError: first)
            self._child.kill()
            self.timeouts_total += n
            each = f" ({self.timeout_s:g}s for each of its {n} responses)" if n > 1 else ""
            return self._fail_all(n, f"reward {self.spec!r} took longer than {timeout_s:g}s{each}")
        except BadChildReply as err:  # never unpickled, never used: the child is replaced
            self._child.kill()
            return self._fail_all(n, f"reward {self.spec!r} process answered with something refused: {err}")
        except ChildStartFailed as err:
            return self._fail_all(n, f"reward {self.spec!r} process: {err}")
        except (EOFError, OSError) as err:
            why = self._child.exit_reason() or f"its pipe broke ({type(err).__name__})"
            self._child.kill()
            return self._fail_all(n, f"reward {self.spec!r} process died: {why}")
        if not (isinstance(reply, list) and len(reply) == 2):
            self._child.kill()
            return self._fail_all(n, f"reward {self.spec!r} process answered {reply!r:.80}, not (status, value)")
        status, value = reply
        if status in ("error", "bad"):
            value = str(value)[:500]  # the child's words, bounded
            if status == "error" and value.startswith("MemoryError") and self.limits.memory_mb:
                value = f"{value.rstrip(': ')} (over its limit of {self.limits.memory_mb} MB of memory)"
            return self._fail_all(n, f"reward {self.spec!r} {'raised ' if status == 'error' else ''}{value}")
        if status != "ok" or not (isinstance(value, list) and len(value) == n):
            self._child.kill()
            return self._fail_all(n, f"reward {self.spec!r} process answered with status {status!r:.40} "
                                     f"and {value!r:.80}, not a result per response")
        return [self._item(item) for item in value]

    def _item(self, item: Any) -> Scored:
        """One response's part of an "ok" reply: ["ok", (value, metrics)] or ["bad", why]."""
        if isinstance(item, list) and len(item) == 2 and item[0] == "bad":
            return self._fail(f"reward {self.spec!r} {str(item[1])[:500]}")
        try:
            if not (isinstance(item, list) and len(item) == 2 and item[0] == "ok"):
                raise BadRewardValue(f"answered {item!r:.120}, not a response's result")
            return _checked_reply(item[1])
        except BadRewardValue as err:
            self._child.kill()
            return self._fail(f"reward {self.spec!r} process {err}")

    def _fail_all(self, n: int, why: str) -> list[Scored]:
        return [self._fail(why) for _ in range(n)]

    def stats(self) -> dict[str, float]:
        return {
            "reward_calls_total": self.calls_total,
            "reward_failures_total": self.failures_total,
            "reward_timeouts_total": self.timeouts_total,
        }

    def close(self) -> None:
        self._child.kill()

    def __del__(self) -> None:
        try:
            self._child.kill()
        except Exception:
            pass


if __name__ == "__main__":
    serve(_reward_handler, _request_units)
