"""Rollout workers: generation engines (vLLM, transformers), the tiny-model kit, tasks, rewards,
and the worker that turns permits into scored, version-tagged groups. Imports `buffer` and `lm`,
never `learner` or `services`."""
