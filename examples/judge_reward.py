"""An LLM judge as the reward: a model-based reward served apart from the run.

The judge is any OpenAI-compatible chat server (`vllm serve JUDGE_MODEL`, or a hosted API). Its
address and key reach the reward's process only when named (the process sees an allow-list of the
worker's environment, never its secrets):

    export JUDGE_BASE_URL=http://judge-host:8000/v1 JUDGE_API_KEY=...   # where the workers run (*)
    etarl train rollout.reward=examples/judge_reward.py:compute_score \
      'rollout.reward_env=[JUDGE_BASE_URL,JUDGE_API_KEY]' rollout.reward_timeout_s=30 \
      'rollout.reward_kwargs={model: Qwen/Qwen2.5-7B-Instruct}'

(*) For `etarl train`'s local cluster, its shell; on a cluster, the job's
`ray job submit --runtime-env-json '{"env_vars": {...}}'` or the nodes' own environment.

verl's batch form: the reward process gets a group's responses in one call and asks the judge
about them at once (`concurrency` requests in flight), within the group's timeouts together
(`rollout.reward_timeout_s` per response). A response whose judge call fails (the judge
unreachable, an HTTP error, an answer without a score; tried twice) gets a value that is no number,
so that response alone scores `failure_reward`, counted, its reason on the worker's log; a judge
that is not configured fails the whole group (said on the console). The run goes on.
"""
from __future__ import annotations

import json
import os
import re
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

PROMPT = """You grade a response against a reference answer.
Reference answer: {reference}
Response: {response}
Is the response's final answer equal to the reference answer? Reply with one line, SCORE: 1 if it is, SCORE: 0 if not."""
_SCORE = re.compile(r"SCORE:\s*([01])\b")
ATTEMPTS = 2


def _ask(base_url: str, key: str, model: str, response: str, reference: str, timeout_s: float) -> float:
    body = {"model": model, "temperature": 0.0, "max_tokens": 16,
            "messages": [{"role": "user", "content": PROMPT.format(reference=reference, response=response)}]}
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(f"{base_url.rstrip('/')}/chat/completions", json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            text = json.load(reply)["choices"][0]["message"]["content"]
    except urllib.error.HTTPError as err:
        hint = " (is JUDGE_API_KEY named in rollout.reward_env?)" if err.code in (401, 403) else ""
        raise RuntimeError(f"the judge at {base_url} answered HTTP {err.code}{hint}") from None
    found = _SCORE.search(text or "")
    if found is None:
        raise ValueError(f"the judge answered {text!r:.100}, not 'SCORE: 0' or 'SCORE: 1'")
    return float(found.group(1))


def _judged(ask, response: str, reference: str) -> float:
    """The judge's score, or NaN (no reward: this response alone fails) after ATTEMPTS failed calls."""
    for attempt in range(ATTEMPTS):
        try:
            return ask(response, reference)
        except (OSError, ValueError, RuntimeError, KeyError) as err:
            if attempt == ATTEMPTS - 1:
                print(f"judge_reward: {type(err).__name__}: {err}", file=sys.stderr)  # the worker's log
    return float("nan")


def compute_score(data_sources, solution_strs, ground_truths, extra_infos, model: str | None = None,
                  concurrency: int = 8, request_timeout_s: float = 20.0) -> list[dict]:
    base_url = os.environ.get("JUDGE_BASE_URL")
    if not base_url:
        raise RuntimeError("JUDGE_BASE_URL is not set in the reward's process: set it where the workers run "
                           "and name it in rollout.reward_env")
    key = os.environ.get("JUDGE_API_KEY", "")
    model = model or os.environ.get("JUDGE_MODEL", "judge")
    def ask(response: str, reference: str) -> float:
        return _ask(base_url, key, model, response, reference, request_timeout_s)

    with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(solution_strs)))) as pool:
        scores = list(pool.map(lambda pair: _judged(ask, pair[0], str(pair[1])), zip(solution_strs, ground_truths)))
    return [score if score != score else {"score": score, "judge_correct": score} for score in scores]  # NaN: failed
