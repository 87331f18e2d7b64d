"""An LLM judge as the reward: a model-based reward served apart from the run.

The judge is any OpenAI-compatible chat server (`vllm serve JUDGE_MODEL`, or a hosted API). Its
address and key reach the reward's process only when named (the process sees an allow-list of the
worker's environment, never its secrets):

    export JUDGE_BASE_URL=http://judge-host:8000/v1 JUDGE_API_KEY=...   # where the workers run
    etarl train rollout.reward=examples/judge_reward.py:compute_score \
      'rollout.reward_env=[JUDGE_BASE_URL,JUDGE_API_KEY]' rollout.reward_timeout_s=30 \
      'rollout.reward_kwargs={model: Qwen/Qwen2.5-7B-Instruct}'

verl's batch form: the reward process gets a group's responses in one call and asks the judge
about them at once (`concurrency` requests in flight), within the group's timeouts together
(`rollout.reward_timeout_s` per response). A judge that cannot be reached, refuses the key or
answers without a score fails the group's rewards (scored `failure_reward`, counted and shown on
the console); the run goes on.
"""
from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

PROMPT = """You grade a response against a reference answer.
Reference answer: {reference}
Response: {response}
Is the response's final answer equal to the reference answer? Reply with one line, SCORE: 1 if it is, SCORE: 0 if not."""
_SCORE = re.compile(r"SCORE:\s*([01](?:\.\d+)?)")


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


def compute_score(data_sources, solution_strs, ground_truths, extra_infos, model: str | None = None,
                  concurrency: int = 8, request_timeout_s: float = 20.0) -> list[dict]:
    base_url = os.environ.get("JUDGE_BASE_URL")
    if not base_url:
        raise RuntimeError("JUDGE_BASE_URL is not set in the reward's process: set it where the workers run "
                           "and name it in rollout.reward_env")
    key = os.environ.get("JUDGE_API_KEY", "")
    model = model or os.environ.get("JUDGE_MODEL", "judge")
    with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(solution_strs)))) as pool:
        scores = list(pool.map(lambda pair: _ask(base_url, key, model, pair[0], str(pair[1]), request_timeout_s),
                                zip(solution_strs, ground_truths)))
    return [{"score": score, "judge_correct": score} for score in scores]
