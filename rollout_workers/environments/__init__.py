"""Multi-turn environments: the API (`base`), the built-ins (`calculator`), resolving a spec
(`registry`) and running environments in child processes with per-call timeouts (`pool`). The
agent loop that drives them is `rollout_workers.agent_loop`."""
from rollout_workers.environments.base import BadEnvironmentResult, Environment, StepResult
from rollout_workers.environments.calculator import Calculator, calculate
from rollout_workers.environments.pool import EnvironmentPool, EnvOutcome
from rollout_workers.environments.registry import BUILTIN_ENVIRONMENTS, resolve_environment

__all__ = ["BUILTIN_ENVIRONMENTS", "BadEnvironmentResult", "Calculator", "EnvOutcome", "Environment",
           "EnvironmentPool", "StepResult", "calculate", "resolve_environment"]
