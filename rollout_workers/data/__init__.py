"""Prompts and where they come from: the built-in synthetic families, prompt files (etarl's flat
form and verl's RL dataset layout), chat templates, and the prompt checks shared by a run's start,
its workers and `etarl data check`."""
from rollout_workers.data.chat import PromptFormat, context_can_stretch, eos_token_ids, model_context_len
from rollout_workers.data.checks import (
    MAX_LISTED,
    InvalidPrompts,
    PromptReport,
    check_prompts,
    heldout_problems,
    train_prompts,
)
from rollout_workers.data.files import BadRow, PromptFile, read_prompt_file
from rollout_workers.data.problems import Problem, PromptSet
from rollout_workers.data.synthetic import (
    ALPHABET,
    DIGITS,
    FAMILIES,
    LETTERS,
    SPLITS,
    mixed_problems,
    synthetic_problems,
)

__all__ = [
    "ALPHABET", "DIGITS", "FAMILIES", "LETTERS", "MAX_LISTED", "SPLITS", "BadRow", "InvalidPrompts", "Problem",
    "PromptFile", "PromptFormat", "PromptReport", "PromptSet", "check_prompts", "context_can_stretch", "eos_token_ids",
    "heldout_problems", "mixed_problems", "model_context_len", "read_prompt_file", "synthetic_problems",
    "train_prompts",
]
