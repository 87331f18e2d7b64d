"""Verifiable prompt sets: built-in synthetic task families and prompt files with reference answers.

A worker's permit carries a ticket, the data cursor; `PromptSet.problem(ticket)` maps it to a
problem (wrapping around after the last one), so a run neither skips nor repeats a prompt.

Built-in families (difficulty = the knob that makes a problem longer):
  add      "37+45="    -> "82"     operands have `difficulty` digits
  reverse  "rev:abc="  -> "cba"    a word of `difficulty + 2` letters from LETTERS
Train and held-out splits are disjoint: a problem's split is decided by a stable hash of its
prompt, so the same seed always gives the same prompts in the same order.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

DIGITS = "0123456789"
LETTERS = "abcdefghij"
FAMILIES = ("add", "reverse")
SPLITS = ("train", "heldout")
# Every character a built-in prompt or answer can contain (the tiny tokenizer's alphabet).
ALPHABET = DIGITS + LETTERS + "+-=:rv "


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str
    family: str = "file"
    difficulty: int = 0


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
    for _ in range(50 * count + 1000):
        problem = _make_problem(family, difficulty, rng)
        if problem.prompt in seen:
            continue
        seen.add(problem.prompt)
        if _split_of(problem.prompt, heldout_percent) == split:
            out.append(problem)
            if len(out) == count:
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


def load_prompt_file(
    path: str | os.PathLike, prompt_key: str = "prompt", answer_key: str = "answer"
) -> list[Problem]:
    """Problems from a JSONL or parquet file; each row needs a prompt and a reference answer."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {str(path)!r} does not exist")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    elif path.suffix in (".jsonl", ".json"):
        rows = []
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not valid JSON ({err.msg})") from None
    else:
        raise ValueError(f"prompt file {str(path)!r} must end in .jsonl or .parquet")
    problems = []
    for number, row in enumerate(rows, start=1):
        missing = [k for k in (prompt_key, answer_key) if not isinstance(row, dict) or row.get(k) is None]
        if missing:
            raise ValueError(f"{path}: row {number} has no {' or '.join(map(repr, missing))}")
        problems.append(Problem(str(row[prompt_key]), str(row[answer_key])))
    if not problems:
        raise ValueError(f"prompt file {str(path)!r} holds no problems")
    return problems


class PromptSet:
    """A fixed, ordered list of problems addressed by ticket (wrapping around)."""

    def __init__(self, problems: list[Problem]) -> None:
        if not problems:
            raise ValueError("a prompt set needs at least one problem")
        self.problems = list(problems)

    def __len__(self) -> int:
        return len(self.problems)

    def problem(self, ticket: int) -> Problem:
        if ticket < 0:
            raise ValueError(f"ticket must be >= 0, got {ticket}")
        return self.problems[ticket % len(self.problems)]


def train_prompts(task) -> PromptSet:
    """The training prompt set of a `rollout_workers.config.TaskConfig`."""
    if task.kind == "file":
        return PromptSet(load_prompt_file(task.path, task.prompt_key, task.answer_key))
    return PromptSet(mixed_problems(list(task.families), list(task.difficulties), "train", task.num_prompts, task.seed))


def heldout_problems(task, count: int, seed: int | None = None) -> list[Problem]:
    """Up to `count` held-out problems of a TaskConfig (never in its training set)."""
    if task.kind == "file":
        if not task.heldout_path:
            raise ValueError("task.kind=file has no task.heldout_path: there is no held-out set to evaluate on")
        return load_prompt_file(task.heldout_path, task.prompt_key, task.answer_key)[:count]
    return mixed_problems(
        list(task.families), list(task.difficulties), "heldout", count, task.seed if seed is None else seed
    )
