"""verl's rule for code rows (data_source codecontests, apps, codeforces, taco: PRIME's Eurus-2-RL-Data,
TACO, DeepCoder-style files): `verl.utils.reward_score.prime_code.compute_score(..., continuous=True)`,
which `default_compute_score` uses when no Sandbox Fusion server is set, written from verl 1dda039.

A row's ground_truth holds its tests: JSON (or a map) {"inputs": [...], "outputs": [...]} and, for a
function to call, "fn_name" (an input is then a JSON value per line, an output one JSON value).
The response's program is what follows its last "```python" up to the next "```" (the whole
response where it has none). Scoring, as verl:
  1. every test in one process, each within 5 s and all within 6 s: all pass -> 1.0;
  2. else each of the first 10 tests alone, as a standard-input program (verl drops fn_name there),
     within 10 s each: the fraction passed (so a call-form program that fails step 1 scores 0).
A standard-input test passes where the printed text equals the expected text after verl's
normalisations (whole text or each line stripped, blank lines dropped, or every line equal as a
number within numpy's allclose tolerances where not all are integers); a call where the returned
value == the expected one (or its first element; tuples as lists).

Each check is a process forked from this process's harness server (`python -I code_harness.py`, started
on the first check; `code_harness.py` says what it does to the program, as verl's harness does), in an
empty temporary folder, with a reward process's scrubbed environment (no keys or tokens), its memory
limit, a CPU limit, a 64 MB file-size limit, and its session killed at the end; the check never sees
the expected outputs (this process compares). It runs the model's code on this machine like verl's
own prime_code: not a security boundary against a hostile program (use containers, or verl's Sandbox
Fusion through verl's own function, for that). A check's seconds count from its saying it is ready.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_workers.child_process import child_environment

CODE_SOURCES = ("codecontests", "apps", "codeforces", "taco")  # verl's data sources scored by prime_code
HARNESS = Path(__file__).with_name("code_harness.py")
ALL_TESTS_TIMEOUT_S = 5  # verl's first check: each test within 5 s, all within 6
EACH_TEST_TIMEOUT_S = 10  # its second: each test alone within 10 s (11 in all)
EACH_TESTS = 10  # tests the second check runs (verl: "some problems have enormous test cases")
# One response at most: both checks to their limits (the reward's timeout must allow it: reward_timeout_s).
WORST_CASE_S = ALL_TESTS_TIMEOUT_S + 1 + EACH_TESTS * (EACH_TEST_TIMEOUT_S + 1)
START_TIMEOUT_S = 60.0  # for the harness's Python to start on a loaded machine
MAX_REPLY_BYTES = 16 * 2**20  # one test's output


class HarnessFailed(RuntimeError):
    """The harness itself did not start or answer as it must (not the program's fault): the reward fails."""


@dataclass(frozen=True)
class CodeTests:
    """A row's tests: inputs and expected outputs as text, and the function to call (None: stdin/stdout)."""

    inputs: list[str]
    outputs: list[str]
    fn_name: str | None = None


def _as_text(value: Any, what: str) -> str:
    """A test's input or output, which verl reads only as text (a list fails verl's every check)."""
    if isinstance(value, str):
        return value
    raise ValueError(f"its ground_truth's {what} is {type(value).__name__}, not text (verl scores such a row 0 "
                     "whatever the response)")


def read_tests(ground_truth: Any) -> CodeTests:
    """A code row's tests from its ground_truth; ValueError saying what is wrong where verl could not run
    them (or, with no tests or fewer outputs than inputs, would score nothing or everything)."""
    tests = ground_truth
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except ValueError:
            raise ValueError("its ground_truth is not JSON test cases ({\"inputs\": [...], \"outputs\": [...]})") \
                from None
    if not (isinstance(tests, dict) and isinstance(tests.get("inputs"), list)
            and isinstance(tests.get("outputs"), list)):
        raise ValueError("its ground_truth is not test cases ({\"inputs\": [...], \"outputs\": [...]})")
    fn_name = tests.get("fn_name")
    if fn_name is not None and not isinstance(fn_name, str):
        raise ValueError(f"its ground_truth's fn_name is {type(fn_name).__name__}, not a function's name")
    inputs, outputs = tests["inputs"], tests["outputs"]
    if not inputs or len(inputs) != len(outputs):
        raise ValueError(f"its ground_truth has {len(inputs)} inputs and {len(outputs)} outputs (verl needs as "
                         "many, at least one: with none every response would score 1)")
    return CodeTests([_as_text(value, f"input {i}") for i, value in enumerate(inputs)],
                     [_as_text(value, f"output {i}") for i, value in enumerate(outputs)], fn_name)


def why_bad_tests(ground_truth: Any) -> str | None:
    """Why a code row's ground_truth cannot be scored (a bad row says it); None when it can."""
    try:
        read_tests(ground_truth)
    except ValueError as err:
        return str(err)
    return None


def program_of(completion: str) -> str:
    """The program in a response, as verl takes it: after the last ```python, up to the next ```."""
    return completion.split("```python")[-1].split("```")[0]


# ---------------------------------------------------------------- verl's comparisons
def _numbers_close(printed: list[str], expected: list[str]) -> bool:
    """verl's last resort: as many lines, not all integers, each equal as a float within numpy.allclose's
    tolerances (rtol 1e-5, atol 1e-8)."""
    if len(printed) != len(expected) or all(a.isdigit() and b.isdigit() for a, b in zip(printed, expected)):
        return False
    try:
        pairs = [(float(a), float(b)) for a, b in zip(printed, expected)]
    except ValueError:
        return False
    return all(a == b or (math.isfinite(a) and math.isfinite(b) and abs(a - b) <= 1e-8 + 1e-5 * abs(b))
               for a, b in pairs)


def stdout_matches(stdout: str, expected: str) -> bool:
    """Whether a standard-input test passed: verl's chain of comparisons (testing_util.run_test), those of
    it that can say yes."""
    lines = stdout.splitlines()
    if "\n".join(lines).strip() == expected.strip() \
            or "\n".join(line.strip() for line in lines).strip() == expected.strip():
        return True
    if lines == [expected]:
        return True
    wanted = [line.strip() for line in expected.split("\n") if line]
    printed = [line for line in lines if line]
    return lines == wanted or printed == wanted or _numbers_close(printed, wanted)


def _untagged(value: Any) -> Any:
    """The harness's tagged JSON as Python values (lists, tuples and dicts as the program returned them)."""
    if isinstance(value, dict):
        if "l" in value:
            return [_untagged(v) for v in value["l"]]
        if "t" in value:
            return tuple(_untagged(v) for v in value["t"])
        return {_untagged(k): _untagged(v) for k, v in value["d"]}
    return value


def _int_keyed(expected: Any) -> Any:
    """verl's undoing of JSON's string keys in an expected value (a dict, or a list's first dict, becomes
    a one-element list of that dict with int keys), left as it was where a key is no int."""
    try:
        if isinstance(expected, dict):
            expected = [{int(k): v for k, v in expected.items()}]
    except (ValueError, TypeError):
        pass
    try:
        if isinstance(expected[0], dict):
            expected = [{int(k): v for k, v in expected[0].items()}]
    except (ValueError, TypeError, KeyError, IndexError):
        pass
    return expected


def value_matches(tagged_value: Any, expected_text: str) -> bool:
    """Whether a call test passed: the value == the expected one, or its first element (tuples as lists)."""
    try:
        expected = _int_keyed(json.loads(expected_text))
        value = _untagged(tagged_value)
        if isinstance(value, tuple):
            value = list(value)
        passed = value == expected
        if isinstance(expected, list) and expected:
            passed = passed or value == expected[0]
        try:
            if isinstance(value[0], tuple):
                passed = passed or [list(x) for x in value] == expected[0]
        except (TypeError, KeyError, IndexError):
            pass
    except (ValueError, TypeError, KeyError, RecursionError):  # an expected value verl could not read either
        return False
    return passed is True


# ---------------------------------------------------------------- running the harness
class _Lines:
    """JSON lines from a check's reply pipe, each waited for until a deadline."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.selector = selectors.DefaultSelector()
        self.selector.register(fd, selectors.EVENT_READ)
        self.buffer = b""

    def next(self, deadline: float) -> dict | None:
        """The next line as a dict; None at the deadline, at the end of the stream, for a line longer
        than MAX_REPLY_BYTES or one that is not a JSON object."""
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or len(self.buffer) > MAX_REPLY_BYTES or not self.selector.select(left):
                return None
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        if len(line) > MAX_REPLY_BYTES:
            return None
        try:
            message = json.loads(line)
        except (ValueError, RecursionError):
            return None
        return message if isinstance(message, dict) else None

    def close(self) -> None:
        self.selector.close()
        os.close(self.fd)


class _ForkServer:
    """This process's harness (`code_harness.serve`): started on the first check, once, and again if it
    died; a check is a process it forks (milliseconds, where a fresh interpreter takes ~130 ms)."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen([sys.executable, "-I", str(HARNESS)], stdin=theirs, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, env=child_environment(), start_new_session=True)
        theirs.close()
        self.control = ours

    def start_check(self, request: bytes, reply_fd: int) -> int:
        """The pid of the process checking `request` (its replies go to reply_fd); OSError or EOFError if the
        server is gone."""
        self.control.settimeout(START_TIMEOUT_S)
        socket.send_fds(self.control, [len(request).to_bytes(8, "big")], [reply_fd])
        self.control.sendall(request)
        pid = b""
        while len(pid) < 8:
            chunk = self.control.recv(8 - len(pid))
            if not chunk:
                raise EOFError("the code harness ended")
            pid += chunk
        return int.from_bytes(pid, "big")

    def close(self) -> None:
        self.control.close()  # it ends on its own then; killed if it does not
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_server: _ForkServer | None = None


def close_harness() -> None:
    """End this process's harness (it ends with the process anyway)."""
    global _server
    if _server is not None:
        _server.close()
        _server = None


def _start_check(request: bytes, reply_fd: int) -> int:
    """A check started on this process's fork server, started (again) where it is not running."""
    global _server
    for attempt in range(2):
        if _server is None or _server.proc.poll() is not None:
            close_harness()
            _server = _ForkServer()
        try:
            return _server.start_check(request, reply_fd)
        except (OSError, EOFError) as err:
            close_harness()
            if attempt:
                raise HarnessFailed(f"the code harness did not start ({type(err).__name__}: {err})") from None
    raise AssertionError("unreachable")


def run_tests(program: str, tests: CodeTests, timeout_s: int, kind: str | None = None) -> list[bool]:
    """Whether the program passed each test, in order, in one harness process, stopping at the first
    failure (a load error, a raise, a wrong output, the timeout): fewer results than tests then, the
    last False. kind: "stdin" or "call" (default: by tests.fn_name)."""
    kind = kind or ("stdin" if tests.fn_name is None else "call")
    folder = tempfile.mkdtemp(prefix="etarl-code-")
    request = json.dumps({"kind": kind, "program": program, "fn_name": tests.fn_name, "inputs": tests.inputs,
                          "timeout_s": timeout_s, "folder": folder}).encode()
    read_fd, write_fd = os.pipe()
    lines, pid = _Lines(read_fd), None
    try:
        try:
            pid = _start_check(request, write_fd)
        finally:
            os.close(write_fd)  # the check holds its own copy: the pipe ends when it does
        if lines.next(time.monotonic() + START_TIMEOUT_S) != {"ready": True}:
            raise HarnessFailed("the code harness's check did not start")
        deadline = time.monotonic() + timeout_s + 1
        results: list[bool] = []
        for expected in tests.outputs:
            message = lines.next(deadline)
            if message is not None and "stdout" in message and isinstance(message["stdout"], str):
                results.append(stdout_matches(message["stdout"], expected))
            elif message is not None and "value" in message and kind == "call":
                results.append(value_matches(message["value"], expected))
            else:  # a load error, a raise, a timeout, a crash, or something the harness never says
                results.append(False)
            if not results[-1]:
                break
        return results
    finally:
        lines.close()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)  # the check and whatever it started (its session)
        shutil.rmtree(folder, ignore_errors=True)


def prime_code_score(completion: str, test_cases: Any, continuous: bool = False) -> tuple[bool | float, list]:
    """verl's prime_code.compute_score: (True, ...) where every test passes at once; else, with continuous,
    (the fraction of the first 10 tests passed one at a time, ...), without it (False, ...) (verl raises
    there); (False, []) for tests it cannot read. The second element is a per-test list of what passed."""
    try:
        tests = read_tests(test_cases)
    except ValueError:
        return False, []
    program = program_of(completion)
    results = run_tests(program, tests, ALL_TESTS_TIMEOUT_S)
    if len(results) == len(tests.inputs) and all(results):
        return True, results
    if not continuous:
        return False, results
    each = [run_tests(program, CodeTests([text], [expected]), EACH_TEST_TIMEOUT_S, kind="stdin") == [True]
            for text, expected in list(zip(tests.inputs, tests.outputs))[:EACH_TESTS]]
    return sum(each) / len(each), each


def prime_code_reward(solution_str: str, ground_truth: Any) -> float:
    """verl's default reward for a code row: prime_code with continuous scores."""
    return float(prime_code_score(solution_str, ground_truth, continuous=True)[0])
