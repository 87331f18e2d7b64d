"""A verl user's run, end to end, as one `etarl train` command in a child process (its own local Ray
cluster): an instruct-model folder (sharded safetensors with an index, a tokenizer with a chat
template, a generation_config with two EOS ids), verl-layout parquet files of chat prompts, and a
`compute_score` reward returning a dict, in a module that only the driver can import: it reaches
the rollout worker through the Ray job's py_modules, as it would on a remote cluster. Train and
held-out prompts come from two files each (verl's `data.train_files` list), the train prompts
shuffled; the held-out files are two data sources, evaluated each on its own."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from chat_model import build_chat_model_folder, write_verl_parquet

from lm.causal_lm import load_tokenizer
from services import checkpoint as ckpt
from services.plots import read_metrics

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    correct = solution_str.strip() == ground_truth
    # Where this module was imported from: Ray's py_modules folder in the workers.
    return {"score": float(correct), "acc": float(correct), "chars": len(solution_str),
            "shipped": float("runtime_resources" in __file__), "verl_row": float(extra_info["index"] >= 0)}
'''
# The driver alone gets the reward's folder on its path (a user's PYTHONPATH on the head node, say);
# the workers get the driver's cwd (the repository) and PYTHONPATH, not that folder.
DRIVER = """import sys
sys.path.insert(0, sys.argv.pop(1))
from services.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_verl_users_data_model_and_reward_train_in_one_command(tiny_model_dir, tmp_path):
    model = build_chat_model_folder(tiny_model_dir, tmp_path / "instruct-model")
    train = [write_verl_parquet(tmp_path / "train.parquet", "train", 40),
             write_verl_parquet(tmp_path / "train2.parquet", "train", 20, seed=1)]
    held = [write_verl_parquet(tmp_path / "test.parquet", "heldout", 4),
            write_verl_parquet(tmp_path / "test2.parquet", "heldout", 4, seed=1, data_source="etarl/reverse2")]
    reward_dir = tmp_path / "my_rewards"
    reward_dir.mkdir()
    (reward_dir / "etarl_e2e_reward.py").write_text(REWARD)
    run_dir = tmp_path / "run"
    args = [f"run.model={model}", "rollout.task.kind=file", f"rollout.task.path=[{train[0]}, {train[1]}]",
            f"rollout.task.heldout_path=[{held[0]}, {held[1]}]", "rollout.task.shuffle=true",
            "rollout.reward=etarl_e2e_reward:compute_score",
            f"run.run_dir={run_dir}", "run.steps=3", "run.eval_every=0", "run.progress=false",
            "eval.num_prompts=8", "eval.n_samples=0", "eval.engine=hf", "buffer.gate.batch_size=2",
            "rollout.sampling.n=4", "rollout.groups_per_batch=2", "ray.num_cpus=2", "ray.worker_num_cpus=0",
            "ray.learner_num_cpus=0"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run([sys.executable, "-c", DRIVER, str(reward_dir), "train", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=540)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    summary = json.loads(done.stdout[done.stdout.index("{"):done.stdout.index("}") + 1])
    assert summary["completed"] and summary["steps"] == 3
    assert f"plots: {run_dir / 'plots'}/*.png" in done.stdout
    assert "reward etarl_e2e_reward:compute_score (verl form)" in output
    assert "code the workers import (reward, environment) travels in the Ray job's py_modules" in output

    records = read_metrics(run_dir)
    steps = [r for r in records if "audit/tickets" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for record in steps:
        # The dict's numbers, averaged over the step's samples; the worker imported the shipped module.
        assert record["reward/shipped"] == 1.0 and record["reward/verl_row"] == 1.0
        assert 0.0 <= record["reward/acc"] <= 1.0 and record["reward/acc"] == pytest.approx(record["reward/mean"])
        assert record["reward/chars"] >= 0
    evals = [r for r in records if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 3] and all(r["eval/num_prompts"] == 8 for r in evals)
    for record in evals:  # each held-out file's data source on its own, the two making up the whole
        parts = [record[f"eval/by_source/{s}/accuracy"] for s in ("etarl/reverse", "etarl/reverse2")]
        assert record["eval/by_source/etarl/reverse2/num_prompts"] == 4
        assert record["eval/accuracy"] == pytest.approx(sum(parts) / 2)

    # The trained policy is still a chat model folder: the tokenizer, its template, both EOS ids.
    policy = ckpt.latest_checkpoint(run_dir) / "policy"
    assert load_tokenizer(policy).chat_template == load_tokenizer(model).chat_template
    assert json.loads((policy / "generation_config.json").read_text())["eos_token_id"] == \
        json.loads((model / "generation_config.json").read_text())["eos_token_id"]
