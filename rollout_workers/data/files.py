"""Prompt files: JSONL or parquet rows, in etarl's flat form or in verl's RL dataset layout.

    flat:  {"prompt": "What is 2+2?", "answer": "4"}
    verl:  {"data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": "What is 2+2?"}],
            "reward_model": {"style": "rule", "ground_truth": "4"},
            "extra_info": {"split": "train", "index": 0}}

A prompt is text, or a list of chat messages (then the model's chat template applies, see
`rollout_workers.data.chat`). Keys are `rollout.task.prompt_key`, `answer_key` (a dotted path
such as `reward_model.ground_truth`; unset: `reward_model.ground_truth` in rows that have a
`reward_model`, else `answer`), `data_source_key` and `extra_info_key`.

Reading never stops at a bad row: each one becomes a `BadRow` (file, row number, why) and the
caller decides (`rollout_workers.data.checks`). Row numbers are 1-based: the line number in a
JSONL file, the row index in a parquet file.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_workers.data.problems import Problem

SUFFIXES = (".jsonl", ".json", ".parquet")
VERL_ANSWER_KEY = "reward_model.ground_truth"
FLAT_ANSWER_KEY = "answer"
_MISSING = object()


@dataclass(frozen=True)
class BadRow:
    source: str
    row: int
    why: str

    def __str__(self) -> str:
        return f"{self.source} row {self.row}: {self.why}"


@dataclass
class PromptFile:
    """What a prompt file holds: its usable problems (in file order) and its bad rows."""

    source: str
    rows: int
    problems: list[Problem]
    bad: list[BadRow]


def lookup(row: dict, key: str) -> Any:
    """row[key], where key may be a dotted path into nested maps ('reward_model.ground_truth');
    a key that itself holds dots wins. _MISSING when absent."""
    if key in row:
        return row[key]
    node: Any = row
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def read_rows(path: str | os.PathLike) -> list[tuple[int, Any]]:
    """(row number, row) for every row of a .jsonl/.json or .parquet file; a line that is not
    JSON comes back as a BadRow. File-level problems (missing, wrong kind) raise."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {str(path)!r} does not exist")
    if path.suffix not in SUFFIXES:
        raise ValueError(f"prompt file {str(path)!r} must end in .jsonl, .json or .parquet")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as err:  # pyarrow raises several types for a file that is not parquet
            raise ValueError(f"prompt file {str(path)!r} is not a readable parquet file ({err})") from None
        return list(enumerate(table.to_pylist(), start=1))
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):  # a .json file holding one array of rows
        try:
            return list(enumerate(json.loads(text), start=1))
        except json.JSONDecodeError as err:
            raise ValueError(f"prompt file {str(path)!r} is not valid JSON ({err})") from None
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                rows.append((number, json.loads(line)))
            except json.JSONDecodeError as err:
                rows.append((number, BadRow(str(path), number, f"not valid JSON ({err.msg})")))
    return rows


def _prompt(value: Any) -> str | list[dict]:
    """A prompt as text or messages; ValueError says what is wrong with it."""
    if isinstance(value, str):
        if not value.strip():
            raise ValueError("empty prompt")
        return value
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"prompt must be text or a list of chat messages, got {type(value).__name__}")
    if not value:
        raise ValueError("empty prompt (no messages)")
    messages = []
    for index, message in enumerate(value, start=1):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"message {index} is not a {{role, content}} map")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"message {index} has no text content")
        messages.append(dict(message))
    if not any(m["content"].strip() for m in messages):
        raise ValueError("empty prompt (every message is blank)")
    return messages


def _answer_keys(row: dict, answer_key: str | None) -> list[str]:
    if answer_key:
        return [answer_key]
    return [VERL_ANSWER_KEY] if "reward_model" in row else [FLAT_ANSWER_KEY]


def row_problem(row: Any, number: int, source: str, task) -> Problem | BadRow:
    """The problem of one row, or why the row cannot be used. `task`: a TaskConfig."""
    def bad(why: str) -> BadRow:
        return BadRow(source, number, why)

    if isinstance(row, BadRow):
        return row
    if not isinstance(row, dict):
        return bad(f"not a map of columns, got {type(row).__name__}")
    prompt = lookup(row, task.prompt_key)
    if prompt is _MISSING or prompt is None:
        return bad(f"no prompt ({task.prompt_key!r})")
    try:
        prompt = _prompt(prompt)
    except ValueError as err:
        return bad(str(err))
    keys = _answer_keys(row, task.answer_key)
    answer = lookup(row, keys[0])
    if answer is _MISSING or answer is None or (isinstance(answer, str) and not answer.strip()):
        return bad(f"no answer ({keys[0]!r}; set rollout.task.answer_key to the column that holds it)")
    data_source = lookup(row, task.data_source_key)
    extra_info = lookup(row, task.extra_info_key)
    return Problem(
        prompt=prompt, answer=answer,
        data_source="" if data_source in (_MISSING, None) else str(data_source),
        extra_info=extra_info if isinstance(extra_info, dict) else None,
        source=source, row=number,
    )


def read_prompt_file(path: str | os.PathLike, task) -> PromptFile:
    """Every row of a prompt file as a Problem or a BadRow (`task`: a TaskConfig for the keys)."""
    source = str(path)
    rows = read_rows(path)
    problems, bad = [], []
    for number, row in rows:
        item = row_problem(row, number, source, task)
        (bad if isinstance(item, BadRow) else problems).append(item)
    return PromptFile(source, len(rows), problems, bad)
