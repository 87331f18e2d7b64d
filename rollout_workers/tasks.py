"""Kept for imports written before the split: prompts and tasks live in `rollout_workers.data`."""
from rollout_workers.data import *  # noqa: F401,F403
from rollout_workers.data import __all__  # noqa: F401
