"""Prompt checks, the same at the start of a run, in each worker and in `etarl data check`.

A row is unusable when it has no prompt or no answer, its prompt is empty (as text or as tokens)
or cannot be rendered by the chat template, or its tokens leave no room for `max_new_tokens`
within the engine's context (vLLM refuses the whole engine batch for such a prompt), unless
`rollout.task.truncation` cuts such prompts to fit (then they are counted as cut). By default a
file with unusable rows refuses to start a run, listing them (file, row number, why; at most
MAX_LISTED and the count); `rollout.task.skip_invalid: true` drops them instead, counted and
logged. Dropping is deterministic, so every worker drops the same rows and tickets map to the
same problems everywhere.
"""
from __future__ import annotations

import itertools
import logging
from collections import Counter
from dataclasses import dataclass, field

from rollout_workers.data.chat import PromptFormat
from rollout_workers.data.files import BadRow, read_prompt_file
from rollout_workers.data.problems import Problem, PromptSet
from rollout_workers.data.synthetic import mixed_problems
from rollout_workers.verl_rewards import why_unscorable_row

log = logging.getLogger(__name__)
MAX_LISTED = 20
MAX_SOURCES = 8  # data sources a summary names, the most rows first


class InvalidPrompts(ValueError):
    """A prompt file has unusable rows and rollout.task.skip_invalid is false."""


@dataclass
class PromptReport:
    """One prompt file checked: its usable problems, its bad rows and the prompts' token counts."""

    source: str
    rows: int
    problems: list[Problem]
    bad: list[BadRow]
    token_counts: list[int] = field(default_factory=list)  # of the usable prompts (empty: not tokenized)
    context_len: int | None = None
    max_new_tokens: int | None = None
    cut: int = 0  # usable prompts cut to fit (rollout.task.truncation)
    truncation: str = "error"

    def token_stats(self) -> dict[str, int]:
        if not self.token_counts:
            return {}
        import numpy as np  # here, not at the top: environment and reward child processes import this package

        counts = np.asarray(self.token_counts)
        # "higher": each percentile is the length of a real prompt (99% of the prompts are at most p99)
        p50, p99 = (int(np.percentile(counts, q, method="higher")) for q in (50, 99))
        return {"p50": p50, "p99": p99, "max": int(counts.max())}

    def summary(self, list_bad: bool = True) -> str:
        """A few lines for a person: counts, token statistics against the context, the bad rows (unless
        `list_bad` is false: where they were listed already)."""
        lines = [f"{self.source}: {self.rows} rows, {len(self.problems)} usable, {len(self.bad)} unusable"]
        stats = self.token_stats()
        if stats:
            room = ""
            if self.context_len:
                new = self.max_new_tokens or 0
                room = (f" (context {self.context_len} - max_new_tokens {new}: prompts of up to "
                        f"{self.context_len - new} tokens fit)")
            lines.append(f"  tokens per prompt: p50 {stats['p50']}, p99 {stats['p99']}, max {stats['max']}{room}")
        sources = Counter(problem.data_source for problem in self.problems if problem.data_source)
        if sources:  # what a verl reward goes by
            shown = ", ".join(f"{source} ({count})" for source, count in sources.most_common(MAX_SOURCES))
            more = f" and {len(sources) - MAX_SOURCES} more" if len(sources) > MAX_SOURCES else ""
            lines.append(f"  data sources: {shown}{more}")
        if self.cut:
            lines.append(f"  {self.cut} prompts cut to fit (rollout.task.truncation={self.truncation})")
        if self.bad and list_bad:
            shown = self.bad[:MAX_LISTED]
            more = f"; the first {len(shown)}" if len(self.bad) > len(shown) else ""
            lines.append(f"  unusable rows ({len(self.bad)}{more}):")
            lines += [f"    {bad}" for bad in shown]
        return "\n".join(lines)

    def usable(self, skip_invalid: bool) -> list[Problem]:
        """The usable problems; with bad rows, raise InvalidPrompts unless skip_invalid (then log them)."""
        if self.bad and not skip_invalid:
            raise InvalidPrompts(f"prompt file has unusable rows, the run does not start:\n{self.summary()}\n"
                                 f"Fix them (for prompts too long: a larger rollout.engine.max_model_len, a "
                                 f"smaller max_new_tokens, or rollout.task.truncation=left to cut them where "
                                 f"max_new_tokens leaves room), or set rollout.task.skip_invalid=true to skip them")
        if self.bad:
            log.warning("skipping %d unusable rows of %s (rollout.task.skip_invalid=true):\n%s", len(self.bad),
                        self.source, "\n".join(f"  {bad}" for bad in self.bad[:MAX_LISTED]))
        if not self.problems:
            raise InvalidPrompts(f"prompt file {self.source!r} holds no usable prompt:\n{self.summary()}")
        return self.problems


def check_prompts(path, task, prompt_format: PromptFormat | None = None,
                  max_new_tokens: int | None = None, reward: str | None = None) -> PromptReport:
    """Read and check a prompt file. Without a PromptFormat only the rows' shape is checked;
    with one, each prompt is rendered and tokenized, and checked against the context. With
    `reward` (the spec that scores the rows: RolloutConfig.rows_reward()) "verl", a row it cannot
    score (its data_source, its ground_truth) is a bad row too."""
    prompt_file = read_prompt_file(path, task)
    report = PromptReport(prompt_file.source, prompt_file.rows, [], list(prompt_file.bad),
                          context_len=prompt_format.context_len if prompt_format else None,
                          max_new_tokens=max_new_tokens,
                          truncation=prompt_format.truncation if prompt_format else "error")
    for problem in prompt_file.problems:
        why, count = _token_problem(problem, prompt_format, max_new_tokens)
        if not why and reward == "verl":
            why = why_unscorable_row(problem.data_source, problem.answer)
        if why:
            report.bad.append(BadRow(report.source, problem.row, why))
            continue
        report.problems.append(problem)
        if count is not None:
            report.token_counts.append(count)
            report.cut += prompt_format.cuts(count, max_new_tokens)
    report.bad.sort(key=lambda bad: bad.row)
    return report


def _token_problem(problem: Problem, prompt_format: PromptFormat | None, max_new_tokens: int | None):
    """(why the problem cannot be generated from, its token count before any cut); why is None when it can."""
    if prompt_format is None:
        return None, None
    try:
        count = len(prompt_format.encode(problem))
    except ValueError as err:
        return str(err), None
    if count == 0:
        return "empty prompt (0 tokens)", None
    room = prompt_format.prompt_room(max_new_tokens)
    if room is not None and count > room and not prompt_format.cuts(count, max_new_tokens):
        return (f"prompt of {count} tokens + max_new_tokens {max_new_tokens or 0} exceeds the engine's context of "
                f"{prompt_format.context_len} tokens"), None
    return None, count


def _usable_problems(task, key: str, prompt_format: PromptFormat | None,
                     max_new_tokens: int | None, reward: str | None) -> list[list[Problem]]:
    """The usable problems of each file of `key` ("path" or "heldout_path")."""
    return [check_prompts(path, task, prompt_format, max_new_tokens, reward).usable(task.skip_invalid)
            for path in task.files(key).values()]


def train_prompts(task, prompt_format: PromptFormat | None = None, max_new_tokens: int | None = None,
                  reward: str | None = None) -> PromptSet:
    """The training prompt set of a TaskConfig (a file's unusable rows refused or skipped; `reward` as
    check_prompts takes it: the driver and every worker skip the same rows)."""
    shuffle_seed = task.seed if task.shuffle else None
    if task.kind == "file":
        files = _usable_problems(task, "path", prompt_format, max_new_tokens, reward)
        return PromptSet([problem for problems in files for problem in problems], shuffle_seed)  # file after file
    return PromptSet(mixed_problems(list(task.families), list(task.difficulties), "train", task.num_prompts, task.seed),
                     shuffle_seed)


def heldout_problems(task, count: int, seed: int | None = None, prompt_format: PromptFormat | None = None,
                     max_new_tokens: int | None = None, reward: str | None = None) -> list[Problem]:
    """Up to `count` held-out problems of a TaskConfig (never in its training set)."""
    if task.kind == "file":
        if not task.heldout_path:
            raise ValueError("task.kind=file has no task.heldout_path: there is no held-out set to evaluate on")
        files = _usable_problems(task, "heldout_path", prompt_format, max_new_tokens, reward)
        # the files' rows taken in turn, so that `count` of them holds some of every file
        taken = (problem for row in itertools.zip_longest(*files) for problem in row if problem is not None)
        return list(itertools.islice(taken, count))
    return mixed_problems(
        list(task.families), list(task.difficulties), "heldout", count, task.seed if seed is None else seed
    )
