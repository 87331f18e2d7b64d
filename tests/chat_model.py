"""A model folder laid out like a real instruct model's, made from the tiny model for the tests:
config.json, safetensors shards with their index, a tokenizer with a chat template, and a
generation_config.json listing two EOS ids (end of turn and end of text, as Qwen2.5-Instruct's
does); and a verl-layout parquet of chat prompts for it."""
from __future__ import annotations

import json
from pathlib import Path

from rollout_workers.data import mixed_problems
from rollout_workers.tiny_model import USER


def build_chat_model_folder(tiny_model_dir, folder) -> Path:
    from lm.causal_lm import load_causal_lm, load_tokenizer

    folder = Path(folder)
    model = load_causal_lm(tiny_model_dir)
    model.save_pretrained(folder, max_shard_size="300KB", safe_serialization=True)
    tokenizer = load_tokenizer(tiny_model_dir)
    tokenizer.save_pretrained(folder)
    end_of_turn = tokenizer.convert_tokens_to_ids(USER)  # a model that opens a new user turn is done
    (folder / "generation_config.json").write_text(json.dumps({
        "bos_token_id": tokenizer.eos_token_id, "eos_token_id": [tokenizer.eos_token_id, end_of_turn],
        "pad_token_id": tokenizer.pad_token_id, "do_sample": True, "temperature": 0.7, "top_p": 0.8}))
    shards = sorted(folder.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 2 and (folder / "model.safetensors.index.json").is_file(), sorted(folder.iterdir())
    assert tokenizer.chat_template, "the tiny kit's tokenizer carries a chat template"
    return folder


def verl_rows(split: str, count: int, seed: int = 0, data_source: str = "etarl/reverse") -> list[dict]:
    """verl's RL layout (as its data preprocessing scripts write it) with the reverse task's prompts as
    chat messages (system + user)."""
    problems = mixed_problems(["reverse"], [2], "train" if split == "train" else "heldout", count, seed)
    return [{"data_source": data_source, "ability": "text",
             "prompt": [{"role": "system", "content": "rev"}, {"role": "user", "content": p.prompt}],
             "reward_model": {"style": "rule", "ground_truth": p.answer},
             "extra_info": {"split": split, "index": i}} for i, p in enumerate(problems)]


def write_verl_parquet(path, split: str, count: int, seed: int = 0, data_source: str = "etarl/reverse") -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(verl_rows(split, count, seed, data_source)), path)
    return Path(path)
