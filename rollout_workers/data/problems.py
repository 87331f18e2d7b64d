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
    """A fixed list of problems addressed by ticket, so a run neither skips nor repeats a prompt: a
    permit's ticket is the data cursor. Ticket t falls in pass t // len of the set; a pass takes the
    problems in list order or, with `shuffle_seed`, in an order drawn from the seed and the pass
    (verl's data.shuffle), the same in every worker and after a resume."""

    def __init__(self, problems: list[Problem], shuffle_seed: int | None = None) -> None:
        if not problems:
            raise ValueError("a prompt set needs at least one problem")
        self.problems = list(problems)
        self.shuffle_seed = shuffle_seed
        # pass -> its order; the last two kept (the tickets of concurrent permits straddle a pass's end)
        self._orders: dict = {}

    def __len__(self) -> int:
        return len(self.problems)

    def problem(self, ticket: int) -> Problem:
        return self.problems[self.position(ticket)]

    def position(self, ticket: int) -> int:
        """Where ticket's problem stands in the list (the same prompt on every pass: its identity)."""
        if ticket < 0:
            raise ValueError(f"ticket must be >= 0, got {ticket}")
        epoch, index = divmod(ticket, len(self.problems))
        return index if self.shuffle_seed is None else int(self._order(epoch)[index])

    def _order(self, epoch: int):
        """The pass's order: an array (a million prompts: 8 MB, where a list of ints takes 36)."""
        order = self._orders.get(epoch)
        if order is None:
            import numpy as np  # here, not at the top: environment and reward child processes import this package

            seed = [self.shuffle_seed % 2**63, epoch]  # numpy takes no negative seed; run.seed may be one
            order = np.random.default_rng(seed).permutation(len(self.problems))
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}
            self._orders[epoch] = order
        return order
