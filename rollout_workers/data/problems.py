"""A problem (one prompt and what its reward needs) and a prompt set addressed by ticket."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Problem:
    """One prompt and its reference. `prompt` is text, or chat messages (a list of
    {"role", "content"} dicts) that go through the model's chat template. `answer` is the
    reference as the file holds it (verl's `ground_truth`: a string, a number, a list ...);
    `data_source` and `extra_info` are verl's columns, passed to a verl-style reward.
    `source` and `row` say where a problem from a file came from (row 0: a built-in one)."""

    prompt: str | list[dict]
    answer: Any
    family: str = "file"
    difficulty: int = 0
    data_source: str = ""
    extra_info: dict | None = None
    source: str = ""
    row: int = 0

    @property
    def is_chat(self) -> bool:
        return not isinstance(self.prompt, str)

    @property
    def answer_text(self) -> str:
        """The reference as text: what a `fn(response, answer)` reward gets."""
        return self.answer if isinstance(self.answer, str) else str(self.answer)

    @property
    def text(self) -> str:
        """A one-line view of the prompt for logs: the text, or the last message's content."""
        return self.prompt if isinstance(self.prompt, str) else str(self.prompt[-1].get("content", ""))

    def where(self) -> str:
        return f"{self.source} row {self.row}" if self.source else f"{self.family} problem"


class PromptSet:
    """A fixed, ordered list of problems addressed by ticket (wrapping around after the last), so a
    run neither skips nor repeats a prompt: a permit's ticket is the data cursor."""

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
