"""A model-based reward through a judge server (examples/judge_reward.py): its address and key reach
the reward process only when named in rollout.reward_env. The judge here is a stand-in HTTP server
speaking the OpenAI chat API on 127.0.0.1 (a judge LLM cannot run usefully on this machine): it
checks the bearer key and grades by comparing the two lines the prompt gives it."""
from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from rollout_workers.config import RolloutConfig
from rollout_workers.data.problems import Problem
from rollout_workers.rewards import RewardRunner

JUDGE = f"{Path(__file__).resolve().parents[2] / 'examples' / 'judge_reward.py'}:compute_score"
KEY = "judge-key-123"


@pytest.fixture
def judge_server():
    seen: list[dict] = []

    class Judge(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append({"path": self.path, "auth": self.headers.get("Authorization"), "model": body["model"]})
            if self.headers.get("Authorization") != f"Bearer {KEY}":
                self.send_response(401)
                self.end_headers()
                return
            prompt = body["messages"][0]["content"]
            reference = re.search(r"Reference answer: (.*)", prompt).group(1)
            response = re.search(r"Response: (.*)", prompt).group(1)
            text = "garbled" if response == "confuse" else f"SCORE: {int(reference == response)}"
            reply = json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Judge)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1", seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def runner_for(**overrides) -> RewardRunner:
    cfg = RolloutConfig(reward=JUDGE, reward_timeout_s=20, reward_kwargs={"model": "my-judge"}, **overrides)
    return RewardRunner.for_rollout(cfg)


def test_a_judge_scores_a_group_with_the_key_named_in_reward_env(judge_server, monkeypatch):
    url, seen = judge_server
    monkeypatch.setenv("JUDGE_BASE_URL", url)
    monkeypatch.setenv("JUDGE_API_KEY", KEY)
    runner = runner_for(reward_env=["JUDGE_BASE_URL", "JUDGE_API_KEY"])
    try:
        assert runner.batch
        scored = runner.score(["42", "41", "42"], Problem("?", "42"))
        assert [s.value for s in scored] == [1.0, 0.0, 1.0], runner.last_error
        assert scored[0].metrics == {"reward/judge_correct": 1.0}
        assert len(seen) == 3 and {(s["auth"], s["model"], s["path"]) for s in seen} == \
            {(f"Bearer {KEY}", "my-judge", "/v1/chat/completions")}
        # a judge answer without a score (twice) fails that response alone; the others are scored
        assert [s.value for s in runner.score(["confuse", "42"], Problem("?", "42"))] == [0.0, 1.0]
        assert "returned nan, not a finite number" in runner.last_error, runner.last_error
        assert runner.stats()["reward_failures_total"] == 1 and len(seen) == 3 + 2 + 1
        assert [s.value for s in runner.score(["7"], Problem("?", "7"))] == [1.0]
    finally:
        runner.close()


def test_without_the_key_named_the_reward_process_never_sees_it(judge_server, monkeypatch, capfd):
    url, seen = judge_server
    monkeypatch.setenv("JUDGE_BASE_URL", url)
    monkeypatch.setenv("JUDGE_API_KEY", KEY)
    runner = runner_for(reward_env=["JUDGE_BASE_URL"])
    try:
        assert [s.value for s in runner.score(["42"], Problem("?", "42"))] == [0.0]
        assert "returned nan" in runner.last_error, runner.last_error
        assert "HTTP 401 (is JUDGE_API_KEY named in rollout.reward_env?)" in capfd.readouterr().err  # the worker's log
        assert seen and seen[-1]["auth"] is None  # the key stayed in the worker
    finally:
        runner.close()
    runner = runner_for()
    try:
        assert [s.value for s in runner.score(["42"], Problem("?", "42"))] == [0.0]
        assert "JUDGE_BASE_URL is not set in the reward's process" in runner.last_error, runner.last_error
    finally:
        runner.close()


@pytest.mark.parametrize("names, why", [
    (["ETARL_BUFFER_CLIENT_SECRET_KEY"], "etarl's own"),
    (["JUDGE KEY"], "not an environment variable name"),
    (["1ST"], "not an environment variable name"),
])
def test_reward_env_refuses_etarls_own_names_and_non_names(names, why):
    with pytest.raises(ValueError, match=why):
        RolloutConfig(reward_env=names)
    from rollout_workers.config import MultiTurnConfig

    with pytest.raises(ValueError, match=why):
        MultiTurnConfig(environment="calculator", environment_env=names)
