"""The learner's checkpoints: sharded training state to resume from, and an HF policy folder.

    folder/trainer_shards/   model + optimizer, and the critic's (gae) (torch.distributed.checkpoint):
                             every rank writes and reads only its own shards; `.metadata` is
                             written last
    folder/trainer.pt        scheduler states, the learner version and the reward KL penalty's β
                             (rank 0; small)
    folder/policy/           the policy as an HF folder for `etarl eval` and users, written
                             bucket by bucket from the shards (rank 0 holds one file's worth);
                             with LoRA its adapted weights merged
    folder/lora_adapter/     with LoRA: the adapters alone as a PEFT folder (adapter_config.json,
                             adapter_model.safetensors) over the run's base model

Only trainable tensors are in the shards: with LoRA the adapters and their optimizer state, not the
frozen base (which the learner reads from its model folder again).

DCP keys tensors by parameter name, not by rank, so a checkpoint loads into another world size
or strategy (FSDP <-> replicas): DCP reshards on load. A checkpoint of the former layout (the full
optimizer state inside trainer.pt, written by rank 0) still loads where it was right, i.e.
without FSDP; under FSDP it is refused: rank 0 held only its own optimizer shards.
"""
from __future__ import annotations

import contextlib
import json
import shutil
import warnings
from pathlib import Path

import torch

from learner.distributed import FullWeightBuckets
from learner.optimizer import load_schedule
from lm.checkpoint_names import expert_naming, to_checkpoint_names

TRAINER_STATE_FILE = "trainer.pt"
SHARDS_DIR = "trainer_shards"
POLICY_DIR = "policy"
ADAPTER_DIR = "lora_adapter"
# the critic's parts (PPO with gae): in the same DCP save and trainer.pt as the policy's
CRITIC_MODEL, CRITIC_OPTIMIZER, CRITIC_SCHEDULER = "critic_model", "critic_optimizer", "critic_scheduler"
# The policy is written in files of about this size: rank 0 holds one of them in host memory.
POLICY_FILE_BYTES = 2 << 30
# Weight files of an HF folder; every other file of the source (tokenizer, chat template, ...) is
# copied beside a saved policy so the folder stays usable as a model.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json", ".lock")


def _state_dict_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Sharded (DTensor) entries under FSDP; plain tensors otherwise; frozen weights (LoRA's base) are
    # the model folder's, not the checkpoint's: loading leaves them as they are (not strict), while
    # DCP's load has already failed on any trainable tensor the checkpoint lacks.
    return StateDictOptions(full_state_dict=False, cpu_offload=False, ignore_frozen_params=True, strict=False)


@contextlib.contextmanager
def _dcp_processes():
    """DCP's `no_dist` for the call inside: True for a learner of one process (no process
    group). DCP warns of that on every save and load even when told so; here it is the plan."""
    import torch.distributed as dist

    no_dist = not (dist.is_available() and dist.is_initialized())
    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield no_dist


def _shard_states(model, optimizer, critic) -> dict:
    """The DCP state: the policy's model and optimizer, and the critic's (None: no critic), as this
    rank's shards under FSDP."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer, options=_state_dict_options())
    state = {"model": _without_frozen(model, model_state), "optimizer": optim_state}
    if critic is not None:
        critic_model, state[CRITIC_OPTIMIZER] = get_state_dict(critic.model, critic.optimizer,
                                                               options=_state_dict_options())
        state[CRITIC_MODEL] = _without_frozen(critic.model, critic_model)
    return state


def _without_frozen(model, state: dict) -> dict:
    """`state` without frozen parameters: `ignore_frozen_params` misses a frozen tied name (a tied LM
    head, 0.9 GB at Qwen2.5-1.5B's vocabulary), which `named_parameters` lists only once."""
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {name: value for name, value in state.items() if name not in frozen}


def save_training_state(folder: Path, model, optimizer, scheduler, version: int, rank: int,
                        kl_reward_coef: float = 0.0, critic=None, lora: dict | None = None) -> None:
    """Every rank: its shards of model and optimizer (and of the `critic`'s: anything with model,
    optimizer and scheduler) into `folder/trainer_shards/`, one DCP save; rank 0 also
    `folder/trainer.pt` (schedulers, version, the reward KL penalty's β, the LoRA settings the
    shards were trained with). A collective under a process group."""
    import torch.distributed.checkpoint as dcp

    with _dcp_processes() as no_dist:
        dcp.save(_shard_states(model, optimizer, critic), checkpoint_id=str(folder / SHARDS_DIR), no_dist=no_dist)
    if rank == 0:
        state = {"scheduler": scheduler.state_dict(), "version": int(version), "shards": SHARDS_DIR,
                 "kl_reward_coef": float(kl_reward_coef), "lora": lora}
        if critic is not None:
            state[CRITIC_SCHEDULER] = critic.scheduler.state_dict()
        torch.save(state, folder / TRAINER_STATE_FILE)


def read_trainer_file(folder: Path) -> dict:
    trainer_file = folder / TRAINER_STATE_FILE
    if not trainer_file.is_file():
        raise FileNotFoundError(f"checkpoint {str(folder)!r} has no {TRAINER_STATE_FILE}")
    return torch.load(trainer_file, map_location="cpu", weights_only=True)


def check_lora_settings(folder: Path, trainer: dict, lora: dict | None) -> None:
    """ValueError unless the checkpoint (its `read_trainer_file`) was trained with these LoRA settings
    (`LoraConfig.model_dump()`, None: every weight trained): other adapters cannot take its shards."""
    if trainer.get("lora") != lora:
        written = f"LoRA {trainer.get('lora')}" if trainer.get("lora") else "no LoRA (every weight trained)"
        raise ValueError(f"checkpoint {str(folder)!r} was trained with {written}; this run has "
                         f"{f'LoRA {lora}' if lora else 'none'}: resume with the run's learner.lora")


def load_training_state(folder: Path, trainer: dict, model, optimizer, critic=None, lora: dict | None = None) -> None:
    """Every rank: its shards of model and optimizer (and the `critic`'s, its scheduler from
    `trainer`, the checkpoint's `read_trainer_file`) from `folder/trainer_shards/` (a collective).
    A run with a critic cannot resume from a checkpoint without one, nor the other way round, nor
    one with other LoRA settings (`lora`: this learner's): the runs train different things."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    shards = folder / SHARDS_DIR
    if not (shards / ".metadata").is_file():
        raise FileNotFoundError(f"checkpoint {str(folder)!r} has no complete {SHARDS_DIR}/ (no .metadata)")
    if (critic is not None) != (CRITIC_SCHEDULER in trainer):
        has = "has a critic" if CRITIC_SCHEDULER in trainer else "has no critic"
        wants = "with one (advantage.estimator gae)" if critic is not None else "without one"
        raise ValueError(f"checkpoint {str(folder)!r} {has}; this learner runs {wants}: resume with the "
                         f"estimator the run was written with")
    check_lora_settings(folder, trainer, lora)
    # DCP loads in place: the state dicts of the live models and optimizers say which shards this
    # rank wants; the optimizer's state is created first (get_state_dict does) so it has slots.
    state = _shard_states(model, optimizer, critic)
    with _dcp_processes() as no_dist:
        dcp.load(state, checkpoint_id=str(shards), no_dist=no_dist)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=_state_dict_options())
    if critic is not None:
        set_state_dict(critic.model, critic.optimizer, model_state_dict=state[CRITIC_MODEL],
                       optim_state_dict=state[CRITIC_OPTIMIZER], options=_state_dict_options())
        load_schedule(critic.scheduler, trainer[CRITIC_SCHEDULER])


def write_policy(folder: Path, model, source_dir: str, rank: int, sharded: bool,
                 file_bytes: int = POLICY_FILE_BYTES) -> Path | None:
    """The policy as an HF folder (config, safetensors, the source's other files), written by rank
    0 one file at a time: under FSDP every rank gathers one file's parameters (`FullWeightBuckets`)
    and rank 0 writes them before the next, so no rank holds the full model. Tied names are
    stored once, as `save_pretrained` does. Every rank must call it under FSDP."""
    from safetensors.torch import save_file

    if not sharded and rank != 0:
        return None  # replicas: rank 0 has everything, nothing to gather
    buckets = FullWeightBuckets(model, file_bytes, keep=rank == 0, out_device="cpu")
    folder = Path(folder)
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
    n = len(buckets)
    files = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map = {}
    for i, tensors in enumerate(buckets):
        if rank != 0:
            continue
        # named as checkpoints and engines name them (an MoE's experts one by one)
        stored = to_checkpoint_names({name: tensors[name].contiguous() for name in buckets.first_names(i)}, copy=True,
                                     naming=expert_naming(model.config))
        save_file(stored, str(folder / files[i]), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(stored, files[i]))
        del tensors, stored  # the next file's gather reuses the memory
    if rank != 0:
        return None
    if n > 1:
        total = sum(buckets.bucket_bytes)
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1), encoding="utf-8")
    model.config.save_pretrained(folder)
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(folder)
    for f in Path(source_dir).iterdir():
        if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES) and not (folder / f.name).exists():
            shutil.copy2(f, folder / f.name)
    return folder


def write_adapter(folder: Path, model, adapters, source_dir: str, rank: int, sharded: bool) -> Path | None:
    """LoRA's adapters alone as a PEFT folder over the base model `source_dir`: adapter_config.json
    and adapter_model.safetensors under PEFT's names (`base_model.model.<layer>.lora_A.weight`),
    what `peft.PeftModel.from_pretrained(base, folder)` loads. Every rank must call it under FSDP
    (each adapter is gathered: at rank 64 on a 7B model about 160 M parameters, 0.6 GB in float32)."""
    from learner.distributed import whole_tensor
    from lm.lora_weights import peft_target_modules, write_peft_folder

    if not sharded and rank != 0:
        return None
    stored = {}
    for name in sorted(adapters.shapes):
        full = whole_tensor(model.get_parameter(name).detach())  # a collective under FSDP
        if rank == 0:
            stored[name] = full.to("cpu")
    if rank != 0:
        return None
    return write_peft_folder(folder, stored, adapters.config.rank, adapters.config.alpha,
                             peft_target_modules(model, adapters.names), source_dir)


def read_policy_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"policy folder {str(folder)!r} holds no .safetensors weights")
    weights = {}
    for f in files:
        weights.update(load_file(str(f)))
    return weights
