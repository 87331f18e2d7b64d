"""What verl's code rule (prime_code, `rollout.reward=verl` on codecontests/apps/codeforces/taco rows) costs
per response here: a right program (one check of all tests), a wrong one (that check, then each of the
first 10 tests alone: 11 checks), and a check's start on the fork server against starting a fresh
interpreter with the harness's imports (the design it replaces), all measured in this run.

    python benchmarks/code_reward.py [--responses 20] [--tests 10]

The last line is a JSON summary.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout_workers import code_harness  # noqa: E402
from rollout_workers.code_tests import close_harness, prime_code_reward  # noqa: E402
from rollout_workers.child_process import child_environment  # noqa: E402

RIGHT = "```python\nn = int(input())\nprint(sum(range(n + 1)))\n```"
WRONG = "```python\nn = int(input())\nprint(sum(range(n)))\n```"  # off by one on every test but 0


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--responses", type=int, default=20, help="responses scored per kind")
    parser.add_argument("--tests", type=int, default=10, help="tests per row")
    args = parser.parse_args()
    tests = json.dumps({"inputs": [f"{i + 1}\n" for i in range(args.tests)],
                        "outputs": [f"{(i + 1) * (i + 2) // 2}\n" for i in range(args.tests)]})
    assert prime_code_reward(RIGHT, tests) == 1.0 and prime_code_reward(WRONG, tests) == 0.0  # also starts the server
    right = timed(lambda: prime_code_reward(RIGHT, tests), args.responses)
    wrong = timed(lambda: prime_code_reward(WRONG, tests), args.responses)
    close_harness()
    imports = "; ".join(f"import {name}" for name in (*code_harness.PRELUDE_STAR, "unittest.mock", "ast", "json"))
    fresh = timed(lambda: subprocess.run([sys.executable, "-I", "-c", imports], check=True, env=child_environment()),
                  args.responses)
    checks_wrong = 1 + min(args.tests, 10)
    summary = {
        "tests_per_row": args.tests,
        "right_response_ms": round(1e3 * statistics.median(right), 2),
        "wrong_response_ms": round(1e3 * statistics.median(wrong), 2),
        "checks_per_wrong_response": checks_wrong,
        "fork_check_ms": round(1e3 * statistics.median(wrong) / checks_wrong, 2),
        "fresh_interpreter_ms": round(1e3 * statistics.median(fresh), 2),
    }
    summary["fresh_over_fork"] = round(summary["fresh_interpreter_ms"] / summary["fork_check_ms"], 2)
    print(f"right response ({args.tests} tests, one check): {summary['right_response_ms']} ms")
    print(f"wrong response ({checks_wrong} checks): {summary['wrong_response_ms']} ms, "
          f"{summary['fork_check_ms']} ms a check")
    print(f"a fresh interpreter with the harness's imports: {summary['fresh_interpreter_ms']} ms "
          f"({summary['fresh_over_fork']}x a forked check, before it runs anything)")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
