"""The transformers engine: `generate` with a KV cache. A portable fallback (no vLLM needed) and a
deliberately different backend from vLLM, so backend mismatch can be measured and corrected.

Log-probs are those of the scores after the logits processors (temperature, top-k, top-p), i.e.
the distribution actually sampled from, as in vLLM's `processed_logprobs`. An MoE model's
completions carry its routers' top-k expert ids per sampled token (`Completion.routed_experts`):
the routing source on CPU, where vLLM returns none.

LoRA (`lora`, set by learner.lora.publish=adapter): each version is A and B alone, merged here into
the adapted weights, W = W0 + alpha/r · B A from a copy of the base weights W0 kept at start (one
more copy of the adapted layers: this engine is for small models).

Requests that sample alike share one generate() call, their prompts left-padded (a step costs
about the same for 32 rows as for 8 where kernel launches, not arithmetic, bound it, as on a GPU
at small sizes). generate() runs greedy and `_Sampler`, its last logits processor, picks: a
seeded request's samples are its seed's whatever shares its call (each row draws from its own
generator, as vLLM samples a seeded request), and only each pick's log-prob is kept.
"""
from __future__ import annotations

import contextlib
import os

import numpy as np
import torch

from lm.causal_lm import load_causal_lm
from lm.checkpoint_names import checkpoint_items, checkpoint_shapes, expert_naming, load_by_checkpoint_names
from lm.device import resolve_device
from lm.lora_weights import adapter_layers, merged_weight, target_shapes
from lm.moe import routers
from rollout_workers.engines.base import (
    Completion,
    GenerationEngine,
    Interrupt,
    SamplingParams,
    WeightsIn,
    check_prompt,
    named_weights,
)


def _calls(members: list[int], lengths: list[int], params: SamplingParams) -> list[list[int]]:
    """`members` (request positions) in generate() calls of at most TOKENS_PER_CALL rows x (longest
    prompt + new tokens), at least one request each; prompts of like length together (less padding)."""
    calls: list[list[int]] = []
    for i in sorted(members, key=lambda i: -lengths[i]):
        call = calls[-1] if calls else None  # longest first: a call's first prompt is its widest
        if call and (len(call) + 1) * params.n * (lengths[call[0]] + params.max_new_tokens) <= TOKENS_PER_CALL:
            call.append(i)
        else:
            calls.append([i])
    return calls


class _Sampler:
    """The last logits processor of a greedy generate() call, which picks every token itself: for
    sampled requests after generate()'s own warpers (temperature, top-k, top-p, in its order), Gumbel
    noise from each row's own generator, so the argmax that generate() takes is a draw from the
    row's processed distribution (the Gumbel-max trick) that depends on its seed alone, not on the
    rows beside it (up to float rounding of the batched forward). Keeps each row's log-prob of its
    pick under the processed scores, step by step: [rows] a step, where keeping the scores
    (`output_scores`) would hold [rows, vocab] a step (16 rows x 8k steps x 152k: 80 GB)."""

    def __init__(self, params: SamplingParams, seeds: list[int] | None, device: torch.device) -> None:
        from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        # seeds: one per row where the request samples; None where it is greedy
        self.generators = None if seeds is None else [torch.Generator(device=device).manual_seed(s) for s in seeds]
        self.log_probs: list[torch.Tensor] = []
        self.processors = []
        if seeds is not None:
            if params.temperature != 1.0:
                self.processors.append(TemperatureLogitsWarper(params.temperature))
            if params.top_k:
                self.processors.append(TopKLogitsWarper(params.top_k))
            if params.top_p < 1.0:
                self.processors.append(TopPLogitsWarper(params.top_p))
        self.processors.append(self)  # the last

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.float()
        if self.generators is not None:
            uniform = torch.stack([torch.rand(scores.shape[-1], generator=g, device=scores.device)
                                   for g in self.generators])
            scores_drawn = scores - torch.log(-torch.log(uniform.clamp_(min=torch.finfo(torch.float32).tiny)))
        else:
            scores_drawn = scores
        pick = scores_drawn.argmax(-1, keepdim=True)  # generate()'s greedy choice over what this returns
        self.log_probs.append(torch.log_softmax(scores, -1).gather(-1, pick).squeeze(-1))
        return scores_drawn


class _InterruptCheck:
    """A stopping criterion that ends the whole generate() call once interrupt() turns true."""

    def __init__(self, interrupt: Interrupt) -> None:
        self.interrupt = interrupt
        self.fired = False

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        self.fired = self.fired or bool(self.interrupt())
        return torch.full((input_ids.shape[0],), self.fired, dtype=torch.bool, device=input_ids.device)


class _RoutingRecorder:
    """Keeps each router's top-k ids of the last position of every row at every forward step of a
    generate() call: step s, which sampled token s, gives [rows, layers, k]."""

    def __init__(self, model) -> None:
        self.layers = routers(model)
        self.calls: list[list[torch.Tensor]] = [[] for _ in self.layers]
        self.rows = 1

    def __enter__(self):
        def hook(index):
            def keep(_module, _args, output):
                ids = output[2]  # (logits, gate weights, expert ids) of [rows x positions] tokens
                self.calls[index].append(ids.reshape(self.rows, -1, ids.shape[-1])[:, -1].to("cpu", torch.int16))
            return keep

        self.handles = [router.register_forward_hook(hook(i)) for i, router in enumerate(self.layers)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()

    def routing(self, steps: int) -> np.ndarray:
        """[rows, steps, layers, k] ids of the first `steps` forward steps."""
        per_layer = [torch.stack(calls[:steps], dim=1) for calls in self.calls]  # [rows, steps, k] each
        ids = torch.stack(per_layer, dim=2).numpy()
        return ids.astype(np.uint8) if ids.size == 0 or ids.max() < 256 else ids


# The most rows x (longest prompt + new tokens) one shared generate() call holds: one group of
# 16 x 8k, as a call of one request always could; requests of the tiny default share by the dozen.
TOKENS_PER_CALL = 131_072


class HFEngine(GenerationEngine):
    def __init__(self, model_dir: str | os.PathLike, dtype: str = "float32", version: int = 0,
                 device: str = "auto", memory_share: float | None = None, seed_requests: bool | None = None,
                 lora=None) -> None:
        """`memory_share`: on a GPU, the most of its memory this process's allocator may hold (a
        colocated learner keeps the rest: the cached blocks of a long generation are not left to
        grow into its share); going over is an out-of-memory error here, naming this engine.
        `seed_requests`: a request's seed decides its samples (None: yes); false: seeds are ignored
        and drawn from the process's random state instead. `lora` (rollout_workers.config.EngineLora):
        versions arrive as adapters."""
        self.device = resolve_device(device, "transformers engine")
        # seeded by default on GPUs too, unlike vLLM: here it costs nothing (every sampled row has a
        # generator of its own either way) and keeps a run's samples reproducible
        self.seed_requests = True if seed_requests is None else seed_requests
        if memory_share is not None and self.device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(memory_share, self.device)
        self.model = load_causal_lm(model_dir, dtype=dtype, device=str(self.device)).eval()
        from transformers import GenerationConfig

        # the folder's sampling defaults (an instruct model's temperature, top_p) are not the run's: every
        # generate() call says all it wants, and transformers would warn that greedy calls ignore them
        self.model.generation_config = GenerationConfig()
        self.dtype = dtype
        self.version = version
        self.vocab_size = self.model.config.vocab_size
        pad = self.model.config.pad_token_id
        self.pad_id = 0 if pad is None else int(pad)
        self.moe = bool(routers(self.model))
        self._receiver = None  # the broadcast's gloo receiver, from the first init call
        self.lora = lora
        self._adapted = {} if lora is None else target_shapes(self.model, lora.target_modules, lora.exclude_modules)
        self._base = {layer: self.model.get_submodule(layer).weight.detach().clone() for layer in self._adapted}
        self._received: int | None = None  # the last version it received

    def generate_batch(
        self, requests: list[tuple[list[int], SamplingParams]], interrupt: Interrupt | None = None
    ) -> list[list[Completion]]:
        prompts = [check_prompt(prompt, self.vocab_size) for prompt, _ in requests]
        results: list[list[Completion] | None] = [None] * len(requests)
        shared: dict[tuple[SamplingParams, bool], list[int]] = {}
        for i, (_, params) in enumerate(requests):
            shared.setdefault((params.with_(seed=None), self._seeded(params)), []).append(i)
        for (params, seeded), members in shared.items():
            for call in _calls(members, [len(p) for p in prompts], params):
                seeds = [requests[i][1].seed for i in call] if seeded else None
                outputs = self._generate([prompts[i] for i in call], params, seeds, interrupt)
                for i, completions in zip(call, outputs):
                    results[i] = completions
        return results

    def _seeded(self, params: SamplingParams) -> bool:
        return self.seed_requests and params.seed is not None and params.temperature > 0

    @torch.no_grad()
    def _generate(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int] | None,
                  interrupt: Interrupt | None) -> list[list[Completion]]:
        """Each prompt's n completions from one generate() call over the left-padded prompts, each
        repeated n times. Sampled requests: sample j of a prompt draws from seed + j (as vLLM's);
        `seeds` None: from seeds taken from the process's random state (which moves on)."""
        from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

        rows = [prompt for prompt in prompts for _ in range(params.n)]
        row_seeds = None  # greedy
        if params.temperature > 0:
            if seeds is None:
                seeds = torch.randint(0, 2**62, (len(prompts),)).tolist()
            row_seeds = [seed + j for seed in seeds for j in range(params.n)]
        sampler = _Sampler(params, row_seeds, self.device)
        config = GenerationConfig(
            max_new_tokens=params.max_new_tokens,
            do_sample=False,  # the sampler picks
            eos_token_id=list(params.stop_token_ids) or None,
            pad_token_id=self.pad_id,
            return_dict_in_generate=True,
        )
        check = _InterruptCheck(interrupt) if interrupt is not None else None
        width = max(len(p) for p in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros_like(ids)
        for row, prompt in enumerate(rows):
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt):] = 1
        recorder = _RoutingRecorder(self.model) if self.moe else contextlib.nullcontext()
        with recorder:
            if self.moe:
                recorder.rows = len(rows)
            out = self.model.generate(
                input_ids=ids.to(self.device),
                attention_mask=attention_mask.to(self.device),
                generation_config=config,
                logits_processor=LogitsProcessorList(sampler.processors),
                stopping_criteria=StoppingCriteriaList([check]) if check else None,
            )
        new_tokens = out.sequences[:, width:]
        routing = recorder.routing(new_tokens.shape[1]) if self.moe else None
        logps = torch.stack(sampler.log_probs, dim=1).tolist() if sampler.log_probs else [[] for _ in rows]
        stops = set(params.stop_token_ids)
        completions = []
        for row, tokens in enumerate(new_tokens.tolist()):
            # a row that stopped before the call's end is padded after its stop token
            end = next((i + 1 for i, t in enumerate(tokens) if t in stops), None)
            if end is not None:
                reason = "stop"
            elif check is not None and check.fired and len(tokens) < params.max_new_tokens:
                reason, end = "interrupted", len(tokens)
            else:
                reason, end = "length", len(tokens)
            completions.append(Completion(tokens[:end], logps[row][:end], reason,
                                          routed_experts=None if routing is None else routing[row, :end]))
        return [completions[i : i + params.n] for i in range(0, len(rows), params.n)]

    def expected_weights(self) -> tuple[dict[str, tuple[int, ...]], set[str]]:
        """Shapes by name of the weights this model takes, as a checkpoint names them (an MoE's experts
        one by one: lm/checkpoint_names.py), and those it may lack (a tied lm_head)."""
        shapes = checkpoint_shapes({k: tuple(v.shape) for k, v in self.model.state_dict().items()},
                                   expert_naming(self.model.config))
        return shapes, {"lm_head.weight"} if self.model.config.tie_word_embeddings else set()

    @torch.no_grad()
    def load_weights(self, version: int, weights: WeightsIn) -> None:
        """Copy the weights into the model as they come (a mapping, or (name, tensor) pairs from a
        stream), named as a checkpoint or as the model in memory. A tensor that does not fit is
        named; a load that fails part-way leaves the engine's version at -1 (its weights are a mix)
        until a whole version is loaded. With `lora` the weights are the version's adapters, checked
        against the adapted layers (a ValueError keeps the engine as it was) and merged."""
        if self.lora is not None:
            adapters = adapter_layers(version, named_weights(weights), self._adapted, self.lora.rank)
            self.version = -1
            with torch.no_grad():
                for layer, (lora_a, lora_b) in adapters.items():
                    weight = self.model.get_submodule(layer).weight
                    weight.copy_(merged_weight(self._base[layer], lora_a, lora_b, self.lora.alpha / self.lora.rank))
            self.version = version
            return
        params = self.model.state_dict()
        shapes, may_lack = self.expected_weights()
        seen, naming = set(), expert_naming(self.model.config)
        self.version = -1
        for name in load_by_checkpoint_names(params, named_weights(weights)):
            if name in params:  # an in-memory name stands for its checkpoint names (a fused one: its experts')
                seen.update(k for k, _ in checkpoint_items(name, params[name], naming=naming))
            else:
                seen.add(name)
        missing = sorted(set(shapes) - seen - may_lack)
        if missing:
            raise ValueError(f"weights do not fit the model: missing {missing[:5]} ({len(missing)} in all)")
        self.version = version

    def weight_transfer(self, op: str, args: dict) -> None:
        """The broadcast's weight-update calls (`lm.weight_sync.subscription`), received in this
        process by the same gloo receiver vLLM's workers run (`lm.weight_sync.gloo_transfer`)."""
        if self.lora is not None:
            raise ValueError("this engine takes each version as LoRA adapters (learner.lora.publish=adapter), through "
                             "the object_store or folder channel")
        if op == "init":
            if "prefix" not in args:
                raise ValueError("the transformers engine receives weights over gloo only (weight_sync.backend: gloo)")
            from lm.weight_sync.gloo_transfer import GlooReceiver

            self._receiver = self._receiver or GlooReceiver()
            self._receiver.init(args, int(args["rank_offset"]))
        elif op == "update":
            weights = self._receiver.receive(args)
            self._received = int(args["version"])
            try:
                self.load_weights(self._received, iter(weights))
            finally:
                del weights
                self._receiver.recycle()
        elif op == "finish":
            if self._received != int(args["version"]):
                raise RuntimeError(f"weights v{args['version']}: finished before it was received")
        elif op not in ("start", "abort"):
            raise ValueError(f"unknown weight-update call {op!r}")
