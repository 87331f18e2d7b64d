"""Rewards that cost ~5 ms per response, for benchmarks/generation.py --long-tail: exact match after
5 ms of CPU (a local verifier: on a machine with few cores it competes with the engine), or after
5 ms of waiting (a remote verifier, a sandbox or a reward model's server: it competes with nothing)."""
import time

COST_S = 0.005


def slow_exact_cpu(response: str, answer: str) -> float:
    until = time.thread_time() + COST_S
    while time.thread_time() < until:
        pass
    return float(response.strip() == answer.strip())


def slow_exact_wait(response: str, answer: str) -> float:
    time.sleep(COST_S)
    return float(response.strip() == answer.strip())
