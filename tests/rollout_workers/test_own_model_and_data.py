"""A verl user's three things in one worker: an instruct-model folder (sharded safetensors with an
index, a tokenizer with a chat template, a generation_config with two EOS ids), verl's parquet
layout with chat prompts, and a `compute_score` reward returning a dict. And a model folder
without a tokenizer, refused with a message that says so."""
from __future__ import annotations

import json

import pytest
from chat_model import build_chat_model_folder, verl_rows, write_verl_parquet
from rollout_helpers import verl_exact

from lm.causal_lm import load_tokenizer
from rollout_workers.config import EngineConfig, RolloutConfig, SamplingConfig, TaskConfig
from rollout_workers.tiny_model import USER
from rollout_workers.worker import RolloutWorker


@pytest.fixture(scope="module")
def chat_model_dir(tiny_model_dir, tmp_path_factory):
    return build_chat_model_folder(tiny_model_dir, tmp_path_factory.mktemp("instruct") / "model")


def test_a_worker_trains_on_verl_data_through_the_chat_template(chat_model_dir, tmp_path):
    train = write_verl_parquet(tmp_path / "train.parquet", "train", 6)
    cfg = RolloutConfig(model_path=str(chat_model_dir), engine=EngineConfig(kind="hf"),
                        sampling=SamplingConfig(n=4, max_new_tokens=6, seed=3),
                        task=TaskConfig(kind="file", path=str(train)), reward="rollout_helpers:verl_exact")
    worker = RolloutWorker(cfg, "worker-chat", buffer_client=None, weight_store=None)
    try:
        worker._ensure_started()
        tokenizer = load_tokenizer(chat_model_dir)
        end_of_turn = tokenizer.convert_tokens_to_ids(USER)
        # The response ends at the tokenizer's EOS and at every EOS of generation_config.json.
        assert worker._sampling_params(0).stop_token_ids == (tokenizer.eos_token_id, end_of_turn)
        rows = verl_rows("train", 6)
        groups = worker.generate_groups([0, 1, 7])  # ticket 7 wraps to row 2
        for group, row in zip(groups, [rows[0], rows[1], rows[1]]):
            expected = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, return_dict=False)
            for sample in group.samples:
                assert sample.prompt_ids.tolist() == list(expected)
                assert tokenizer.decode(sample.prompt_ids.tolist()).startswith(f"<|user|>rev<eos><|user|>rev:")
                text = tokenizer.decode(sample.response_ids.tolist(), skip_special_tokens=True)
                want = verl_exact(row["data_source"], text, row["reward_model"]["ground_truth"], row["extra_info"])
                assert sample.reward == want["score"]
                assert sample.metadata["reward/acc"] == want["acc"] and sample.metadata["reward/has_extra"] == 1.0
                if sample.finish_reason == "stop":
                    assert sample.response_ids[-1] in (tokenizer.eos_token_id, end_of_turn)
                else:
                    assert len(sample.response_ids) == cfg.sampling.max_new_tokens
        assert worker.stats()["reward_failures_total"] == 0
    finally:
        worker.close()


def test_a_worker_scores_each_group_in_one_call_of_a_verl_batch_reward(chat_model_dir, tmp_path):
    train = write_verl_parquet(tmp_path / "train.parquet", "train", 3)
    cfg = RolloutConfig(model_path=str(chat_model_dir), engine=EngineConfig(kind="hf"),
                        sampling=SamplingConfig(n=4, max_new_tokens=6, seed=5),
                        task=TaskConfig(kind="file", path=str(train)),
                        reward="rollout_helpers:verl_batch_exact", reward_kwargs={"bonus": 1.0})
    worker = RolloutWorker(cfg, "worker-batch-reward", buffer_client=None, weight_store=None)
    try:
        worker._ensure_started()
        tokenizer = load_tokenizer(chat_model_dir)
        rows = verl_rows("train", 3)
        groups = worker.generate_groups([0, 2])
        for group, row in zip(groups, [rows[0], rows[2]]):
            assert len(group.samples) == 4
            for sample in group.samples:
                text = tokenizer.decode(sample.response_ids.tolist(), skip_special_tokens=True)
                assert sample.reward == float(text == row["reward_model"]["ground_truth"]) + 1.0
                assert sample.metadata["reward/batch_size"] == 4.0  # the group's four in one call
                assert sample.metadata["reward/has_extra"] == 1.0
        assert worker.stats()["reward_failures_total"] == 0
        assert worker.stats()["reward_calls_total"] == 8
    finally:
        worker.close()


def test_a_worker_cuts_a_prompt_too_long_from_the_left_and_keeps_the_generation_prompt(chat_model_dir, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = verl_rows("train", 2)
    rows[1]["prompt"][0]["content"] = "rev " * 30  # a long system message: the prompt is past the room
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    cfg = RolloutConfig(model_path=str(chat_model_dir), engine=EngineConfig(kind="hf", max_model_len=32),
                        sampling=SamplingConfig(n=2, max_new_tokens=6, seed=3),
                        task=TaskConfig(kind="file", path=str(tmp_path / "train.parquet"), truncation="left"),
                        reward="rollout_helpers:verl_exact")
    worker = RolloutWorker(cfg, "worker-truncation", buffer_client=None, weight_store=None)
    try:
        worker._ensure_started()
        tokenizer = load_tokenizer(chat_model_dir)
        whole = [list(tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, return_dict=False))
                 for row in rows]
        assert len(whole[0]) <= 26 < len(whole[1])
        for group, want in zip(worker.generate_groups([0, 1]), [whole[0], whole[1][-26:]]):
            for sample in group.samples:
                assert sample.prompt_ids.tolist() == want  # the last 32 - 6 tokens: the user's turn kept
                assert len(sample.prompt_ids) + len(sample.response_ids) <= 32
    finally:
        worker.close()


def test_a_model_folder_without_a_tokenizer_is_refused_clearly(chat_model_dir, tmp_path):
    folder = tmp_path / "weights-only"
    folder.mkdir()
    for f in chat_model_dir.iterdir():
        if f.name.endswith((".safetensors", ".json")) and "token" not in f.name:
            (folder / f.name).write_bytes(f.read_bytes())
    with pytest.raises(FileNotFoundError, match="has no tokenizer .*tokenizer.json.*copy the tokenizer files"):
        load_tokenizer(folder)
    from services.cli import EXIT_CONFIG_ERROR, main

    assert main(["train", f"run.model={folder}", f"run.run_dir={tmp_path / 'run'}", "run.progress=false"]) \
        == EXIT_CONFIG_ERROR


def test_the_instruct_folder_is_what_real_ones_look_like(chat_model_dir):
    index = json.loads((chat_model_dir / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 2 and all((chat_model_dir / shard).is_file() for shard in shards)
    assert json.loads((chat_model_dir / "generation_config.json").read_text())["eos_token_id"][1] > 1
