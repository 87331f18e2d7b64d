"""verl's code rows (prime_code) score in etarl as in verl: each case's expected score is what verl's own
`prime_code.compute_score(..., continuous=True)` (verl 1dda039) returned for it, quirks included (exit()
fails under verl's guard, a program's first blank line decides what runs at load, a call-form program
gets no partial credit, only the first 10 tests count one by one). Real harness processes; the
program's time limits are shortened where a test waits for one."""
from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import pytest

from rollout_workers import code_tests
from rollout_workers.code_tests import (CodeTests, HarnessFailed, prime_code_reward, prime_code_score, read_tests,
                                        run_tests, stdout_matches, value_matches)
from rollout_workers.config import RolloutConfig
from rollout_workers.data.problems import Problem
from rollout_workers.rewards import Reward, RewardRunner
from rollout_helpers import wait_until


@pytest.fixture(autouse=True)
def harness_ends_with_the_test():
    yield
    code_tests.close_harness()


def stdin_tests(inputs, outputs) -> str:
    return json.dumps({"inputs": inputs, "outputs": outputs})


def call_tests(fn_name, inputs, outputs) -> str:
    return json.dumps({"fn_name": fn_name, "inputs": inputs, "outputs": outputs})


def fenced(program: str) -> str:
    return f"Here:\n```python\n{program}\n```"


ADD = stdin_tests(["1 2\n", "3 4\n"], ["3\n", "7\n"])
READ_ADD = "a,b=map(int,input().split())\n"
COUNT = stdin_tests([f"{i}\n" for i in range(12)], [f"{i}\n" for i in range(12)])
VERL_SCORES = [  # (program, tests, verl's score)
    (READ_ADD + "print(a+b, ' ')", ADD, 1.0),  # lines stripped
    (READ_ADD + "print()\nprint(a+b)\nprint()", ADD, 1.0),  # blank lines dropped
    ("a,b=map(int,input().split())\nprint(a/b)", stdin_tests(["1 3\n", "2 3\n"], ["0.333333\n", "0.666667\n"]), 1.0),
    (READ_ADD + "print(a/b+0.001)", stdin_tests(["1 3\n"], ["0.333333\n"]), 0.0),  # past allclose
    ("print(0.3333333, 1.0)", stdin_tests(["\n"], ["0.333333 1.000000\n"]), 0.0),  # numbers line by line only
    ("def main():\n    " + READ_ADD + "    print(a+b)\n\nif __name__ == \"__main__\":\n    main()\n", ADD, 1.0),
    ("def main():\n    " + READ_ADD + "    print(a+b)\nif __name__ == '__main__':\n    main()\nx = 1", ADD, 0.0),
    ("import sys, threading\ndef main():\n    " + READ_ADD + "    print(a+b)\nthreading.stack_size(2**26)\n"
     "t=threading.Thread(target=main)\nt.start()\nt.join()", ADD, 1.0),
    ("import sys\na,b=map(int,sys.stdin.buffer.readline().split())\nprint(a+b)", ADD, 0.0),
    ("a,b=map(int,open(0).read().split())\nprint(a+b)", ADD, 0.0),  # the prelude's open is the real one
    ("import sys\ninput = sys.stdin.readline\n" + READ_ADD + "print(a+b)", ADD, 1.0),
    ("from sys import stdin\nt=0\nwhile True:\n    l=stdin.readline()\n    if not l: break\n"
     "    t+=sum(map(int,l.split()))\nprint(t)", ADD, 1.0),
    (READ_ADD + "print(a+b)\nexit()", ADD, 0.0),  # verl's guard: exit is None
    ("import sys\n" + READ_ADD + "print(a+b)\nsys.exit()", ADD, 1.0),
    ("import sys\nsys.setrecursionlimit(10000)\ndef f(n): return 0 if n==0 else 1+f(n-1)\n" + READ_ADD
     + "print(f(a)+b)", ADD, 1.0),
    (READ_ADD + "print(a+b+gcd(a,a)-a)", ADD, 1.0),  # the prelude's star imports
    ("x = 0\ndef f():\n    global x\n    x += 1\nf()\n" + READ_ADD + "print(a+b+x-1)", ADD, 0.0),  # inside code()
    ("s = '''a\nb'''\n" + READ_ADD + "print(a+b if len(s)==3 else -1)", ADD, 0.0),  # a tab lands in the string
    ("from sys import stdout\n" + READ_ADD + "stdout.write(str(a+b)+'\\n')", ADD, 1.0),
    ("import sys\n" + READ_ADD + "assert a == 1\nprint(a+b)", ADD, 0.5),
    ("n=int(input())\nprint(n if n != 10 else -1)", COUNT, 1.0),  # the 11th test is not run one by one
    ("n=int(input())\nprint(n if n != 2 else -1)", COUNT, 0.9),
    (READ_ADD + "print(a+b, end='')", ADD, 1.0),
    ("import numpy as np\n" + READ_ADD + "print(int(np.int64(a)+b))", ADD, 1.0),
    ("input()\nprint('héllo ✓')", stdin_tests(["x\n"], ["héllo ✓\n"]), 1.0),
    ("import sys\nfor line in sys.stdin:\n    a,b=map(int,line.split())\n    print(a+b)", ADD, 1.0),
    (READ_ADD + "print(a, b)", stdin_tests(["1 2\n"], ["1  2\n"]), 0.0),
    ("print(1)\nprint(2)", stdin_tests(["\n"], ["1\n\n2\n"]), 1.0),
    ("def f(:\n  pass", ADD, 0.0),
    ("print(float('nan'))", stdin_tests(["\n"], ["nan\n"]), 1.0),
    ("print('1\\r\\n2', end='')", stdin_tests(["\n"], ["1\n2\n"]), 1.0),
    ("print('x')\ndef add(a, b):\n    return a + b", call_tests("add", ["1\n2", "3\n4"], ["3", "7"]), 1.0),
    ("def add(a, b):\n    return a + b if a == 1 else 0", call_tests("add", ["1\n2", "3\n4"], ["3", "7"]), 0.0),
    ("class Solution:\n    def add(self, a, b):\n        return [a, b]", call_tests("add", ["1\n2"], ["[1, 2]"]), 1.0),
    ("class Solution:\n    def add(self, a, b):\n        return [a, b]", call_tests("add", ["1\n2"], ["[[1, 2]]"]),
     1.0),
    ("def f(a):\n    return (a, a)", call_tests("f", ["1"], ["[1, 1]"]), 1.0),
    ("def f(a):\n    return [(a, a), (a, a)]", call_tests("f", ["1"], ["[[1, 1], [1, 1]]"]), 0.0),
    ("def f(a):\n    return [(a, a), (a, a)]", call_tests("f", ["1"], ["[[[1, 1], [1, 1]]]"]), 1.0),
    ("def f(a):\n    return {1: a}", call_tests("f", ["5"], ['{"1": 5}']), 1.0),
    ("def f(d):\n    return sum(k * v for k, v in d.items())", call_tests("f", ['{"2": 3}'], ["6"]), 1.0),
    ("def f(a):\n    return {a}", call_tests("f", ["1"], ["[1]"]), 0.0),  # JSON cannot hold a set
    ("def f(a):\n    return True", call_tests("f", ["1"], ["1"]), 1.0),
    ("def f(a):\n    return 0.1 + 0.2", call_tests("f", ["1"], ["0.3"]), 0.0),
    ("def f(a):\n    return a", call_tests("f", ["1\n"], ["1"]), 0.0),  # a trailing newline is an empty argument
    ("def g(a):\n    return a", call_tests("f", ["1"], ["1"]), 0.0),
    ("seen = []\ndef f(a):\n    seen.append(a)\n    return len(seen)", call_tests("f", ["1", "1"], ["1", "1"]), 0.0),
    ("def f(a):\n    return 10**5000", call_tests("f", ["1"], ["1"]), 0.0),
]


@pytest.mark.parametrize("program,tests,verl_score", VERL_SCORES)
def test_a_program_scores_as_verls_prime_code_scores_it(program, tests, verl_score):
    assert prime_code_reward(fenced(program), tests) == verl_score


def test_the_program_is_the_last_python_block_or_the_whole_response():
    response = "First:\n```python\nprint('wrong')\n```\nBetter:\n```python\n" + READ_ADD + "print(a+b)\n```\nDone."
    assert prime_code_reward(response, ADD) == 1.0
    assert prime_code_reward(READ_ADD + "print(a+b)", ADD) == 1.0


def test_standard_output_comparisons_are_verls():
    assert stdout_matches("3 \n", "3\n") and stdout_matches("\n3\n\n", "3") and stdout_matches("1\n2", "1\n\n2\n")
    assert stdout_matches("0.3333333\n", "0.333333") and stdout_matches("inf\n", "inf")
    assert not stdout_matches("inf\n", "-inf") and not stdout_matches("nan\n", "0")
    assert not stdout_matches("1 2", "1  2") and not stdout_matches("0.34", "0.333333")
    assert not stdout_matches("²", "2")  # an int line by isdigit, so no float comparison; text differs


def test_call_comparisons_are_verls():
    assert value_matches({"t": [1, 1]}, "[1, 1]") and value_matches(True, "1") and value_matches(1.0, "1")
    assert value_matches({"d": [[1, 5]]}, '{"1": 5}') and not value_matches({"d": [["1", 5]]}, '{"1": 5}')
    assert value_matches({"l": [{"t": [1, 1]}]}, "[[[1, 1]]]")  # [(1, 1)]: its tuples as lists == the first element
    assert not value_matches({"l": [{"t": [1, 1]}]}, "[[1, 1]]")  # ... and only that
    assert not value_matches(1, "not json") and not value_matches({"x": 1}, "1")  # a forged tag fails, no raise


@pytest.mark.parametrize("ground_truth,why", [
    ("not json", "is not JSON test cases"), ("4", "is not test cases"), ({"inputs": ["1"]}, "is not test cases"),
    ({"inputs": [], "outputs": []}, "has 0 inputs and 0 outputs"), ({"inputs": ["1", "2"], "outputs": ["1"]}, "has 2"),
    ({"inputs": [["1"]], "outputs": ["1"]}, "input 0 is list, not text"),
    ({"inputs": ["1"], "outputs": [1]}, "output 0 is int, not text"),
    ({"fn_name": ["f"], "inputs": ["1"], "outputs": ["1"]}, "fn_name is list")])
def test_tests_verl_cannot_run_are_named(ground_truth, why):
    with pytest.raises(ValueError, match=why):
        read_tests(ground_truth)
    assert prime_code_reward(READ_ADD, ground_truth) == 0.0  # reached anyway (a custom reward's call): 0, no raise


def test_a_program_past_its_time_fails_its_test_and_the_process_is_gone(monkeypatch, tmp_path):
    monkeypatch.setattr(code_tests, "ALL_TESTS_TIMEOUT_S", 1)
    monkeypatch.setattr(code_tests, "EACH_TEST_TIMEOUT_S", 1)
    loop = "n=int(input())\nif n == 1:\n    while True: pass\nprint(n)"
    tests = stdin_tests(["0\n", "1\n", "2\n"], ["0\n", "1\n", "2\n"])
    assert prime_code_reward(loop, tests) == pytest.approx(2 / 3)
    pid_file = tmp_path / "pid"
    sleeper = f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\nwhile True: time.sleep(1)"
    started = time.monotonic()
    assert run_tests(sleeper, read_tests(tests), timeout_s=1) == [False]
    assert time.monotonic() - started < 30  # bounded by the deadline, not by the program
    pid = int(pid_file.read_text())
    wait_until(lambda: ended(pid), timeout=60, what=f"the check {pid} still runs after its deadline")


def ended(pid: int) -> bool:
    """Whether a process is gone or a zombie (killed, not yet reaped by its server)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_the_program_sees_no_secret_and_leaves_nothing_behind(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_API_KEY", "secret-key")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where its folder is made
    spy = "import os\nopen('left.txt', 'w').write('x')\nprint(os.environ.get('WANDB_API_KEY'), os.listdir('.'))"
    assert run_tests(spy, read_tests(stdin_tests(["\n"], ["None ['left.txt']\n"])), timeout_s=5) == [True]
    assert list(tmp_path.iterdir()) == []


def test_a_program_writing_to_the_reply_pipe_gains_nothing():
    """The harness never sees the expected outputs: a program can only claim outputs, which it could print."""
    forger = ("import os\nfor fd in range(3, 12):\n    try:\n"
              "        os.write(fd, b'{\"passed\": true}\\n{\"value\": 3}\\n{\"ready\": true}\\n')\n"
              "    except OSError:\n        pass\nprint(0)")
    assert prime_code_reward(forger, ADD) == 0.0
    garbage = "import os\nfor fd in range(3, 12):\n    try: os.write(fd, b'[[[[' * 100000)\n    except OSError: pass"
    assert prime_code_reward(garbage, ADD) == 0.0


def test_a_harness_that_cannot_start_is_an_error_not_a_zero(monkeypatch, tmp_path):
    monkeypatch.setattr(code_tests, "HARNESS", tmp_path / "missing.py")
    with pytest.raises(HarnessFailed, match="the code harness did not start"):
        prime_code_score(READ_ADD, ADD)


def test_a_harness_that_died_is_started_again_and_ends_when_closed():
    right = fenced(READ_ADD + "print(a+b)")
    assert prime_code_reward(right, ADD) == 1.0
    server = code_tests._server.proc
    server.kill()
    server.wait()
    assert prime_code_reward(right, ADD) == 1.0  # a new server
    assert code_tests._server.proc is not server
    restarted = code_tests._server.proc
    code_tests.close_harness()
    assert restarted.poll() is not None  # it ended when its socket closed


def test_verls_reward_scores_code_rows_in_the_reward_process():
    problem = Problem("add", ADD, data_source="codeforces")
    runner = RewardRunner.for_rollout(RolloutConfig(reward="verl"))
    try:
        assert runner.timeout_s == 120  # the default for verl's rules: a code row may take 116 s
        scored = runner.score([fenced(READ_ADD + "print(a+b)"), fenced(READ_ADD + "print(a*b)"), "no code"], problem)
        assert [s.value for s in scored] == [1.0, 0.0, 0.0], runner.last_error
    finally:
        runner.close()


def test_a_reward_file_written_for_verl_calls_prime_code_without_verl(tmp_path):
    path = tmp_path / "code_reward.py"
    path.write_text("from verl.utils.reward_score import prime_code, default_compute_score\n\n"
                    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    if data_source == 'strict':\n"
                    "        return float(prime_code.compute_score(solution_str, ground_truth)[0])\n"
                    "    if data_source == 'sandbox':\n"
                    "        return default_compute_score('taco', solution_str, ground_truth, "
                    "sandbox_fusion_url='http://127.0.0.1:1')\n"
                    "    return default_compute_score(data_source, solution_str, ground_truth)\n")
    reward = Reward(f"{path}:compute_score")
    half = fenced(READ_ADD + "print(a+b if a == 1 else 0)")
    assert reward(half, Problem("?", ADD, data_source="apps")).value == 0.5
    assert reward(half, Problem("?", ADD, data_source="strict")).value == 0.0  # continuous=False: all or nothing
    with pytest.raises(ValueError, match="etarl has no Sandbox Fusion client"):
        reward(half, Problem("?", ADD, data_source="sandbox"))


def test_the_reply_reader_refuses_an_overlong_line(monkeypatch):
    monkeypatch.setattr(code_tests, "MAX_REPLY_BYTES", 1000)
    assert run_tests("print('x' * 5000)", CodeTests(["\n"], ["x" * 5000]), timeout_s=5) == [False]
    assert run_tests("print('x' * 500)", CodeTests(["\n"], ["x" * 500]), timeout_s=5) == [True]
