"""The built-in synthetic task families: verifiable problems made from a seed.

Built-in families (difficulty = the knob that makes a problem longer):
  add      "37+45="    -> "82"     operands have `difficulty` digits
  reverse  "rev:abc="  -> "cba"    a word of `difficulty + 2` letters from LETTERS
Train and held-out splits are disjoint: a problem's split is decided by a stable hash of its
prompt, so the same seed always gives the same prompts in the same order.
"""
from __future__ import annotations

import hashlib
import random

from rollout_workers.data.problems import Problem

DIGITS = "0123456789"
LETTERS = "abcdefghij"
FAMILIES = ("add", "reverse")
SPLITS = ("train", "heldout")
# Every character a built-in prompt or answer can contain (the tiny tokenizer's alphabet).
ALPHABET = DIGITS + LETTERS + "+-=:rv "


def _split_of(prompt: str, heldout_percent: int) -> str:
    bucket = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:4], "big") % 100
    return "heldout" if bucket < heldout_percent else "train"


def _make_problem(family: str, difficulty: int, rng: random.Random) -> Problem:
    if family == "add":
        low = 0 if difficulty == 1 else 10 ** (difficulty - 1)
        a, b = rng.randint(low, 10**difficulty - 1), rng.randint(low, 10**difficulty - 1)
        return Problem(f"{a}+{b}=", str(a + b), family, difficulty)
    if family == "reverse":
        word = "".join(rng.choice(LETTERS) for _ in range(difficulty + 2))
        return Problem(f"rev:{word}=", word[::-1], family, difficulty)
    raise ValueError(f"unknown task family {family!r}; built-in families are {FAMILIES}")


def _distinct_prompts(family: str, difficulty: int) -> int:
    """How many different prompts a family has at a difficulty (1-digit addition: 100)."""
    if family == "add":
        return (10**difficulty - (0 if difficulty == 1 else 10 ** (difficulty - 1))) ** 2
    return len(LETTERS) ** (difficulty + 2)


def synthetic_problems(
    family: str, difficulty: int, split: str, count: int, seed: int = 0, heldout_percent: int = 10
) -> list[Problem]:
    """Up to `count` distinct problems of one family and difficulty from one split, in a fixed
    order for a given seed (fewer when the problem space is small, e.g. 1-digit addition)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if difficulty < 1:
        raise ValueError(f"difficulty must be >= 1, got {difficulty}")
    rng = random.Random(f"{seed}:{family}:{difficulty}")
    seen: set[str] = set()
    out: list[Problem] = []
    space = _distinct_prompts(family, difficulty) if family in FAMILIES else None  # else _make_problem says why
    for _ in range(50 * count + 1000):
        problem = _make_problem(family, difficulty, rng)
        if problem.prompt in seen:
            continue
        seen.add(problem.prompt)
        if _split_of(problem.prompt, heldout_percent) == split:
            out.append(problem)
            if len(out) == count:
                break
        if len(seen) == space:  # every prompt drawn: the rest of the draws would only repeat them
            break
    return out


def mixed_problems(
    families: list[str], difficulties: list[int], split: str, count: int, seed: int = 0
) -> list[Problem]:
    """Interleave every (family, difficulty) pair round-robin, so any window of tickets sees the
    whole mix; `count` is the total, shared evenly."""
    pools = [
        synthetic_problems(f, d, split, -(-count // (len(families) * len(difficulties))), seed)
        for f in families
        for d in difficulties
    ]
    out: list[Problem] = []
    for row in range(max(len(p) for p in pools)):
        out.extend(pool[row] for pool in pools if row < len(pool))
    return out[:count]
