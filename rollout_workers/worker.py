"""The rollout worker: permits in, scored and version-tagged groups out.

A plain class; services makes it a Ray actor (`ray.remote(RolloutWorker)`, with max_restarts and
max_concurrency > 1 so `stop()` and `stats()` run while `run()` loops). The loop:
  1. load new weights if the store has a newer version (between generations);
  2. acquire permits for one engine batch (the η gate; each ticket picks a prompt), unless the
     last push already brought them;
  3. generate a group of n per permit, score it, tag every sample (weight_version,
     token_versions, worker_id) and push the groups under their permits, taking the next
     batch's permits in the same request (one request per batch while the gate is open);
  4. on any failure release the permit (its ticket is reissued) and carry on. An engine batch that
     fails is generated again prompt by prompt; a prompt that keeps failing on its own while the
     engine serves others is quarantined (its ticket is never reissued), so one bad prompt cannot
     stall the run. A weight load that fails is retried, then the worker asks to be restarted
     (`WorkerNeedsRestart`: the pool restarts its actor within `ray.worker_max_restarts`).
With `interrupt_on_update`, a new version aborts the generation in flight; the worker loads the
weights and continues each unfinished response from where it stopped, so its earlier tokens keep
their old version in token_versions. The weights in the model folder are version 0; a (re)started
worker loads the store's latest version before its first generation. A killed worker's permit
comes back through the buffer's lease.
With `rollout.multi_turn.environment` set, step 3 runs the agent loop (`rollout_workers.agent_loop`):
trajectories of turns and environment observations, new weights loaded between turns.
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import deque

import numpy as np

from buffer.errors import GROUP_REFUSALS, BufferError, BufferUnavailable
from buffer.sample import REWARD_BASELINE, Group, Sample, new_id
from lm.causal_lm import load_tokenizer
from lm.device import gpu_memory_peaks
from lm.weight_sync import WeightSubscription
from lm.weight_sync.group import call
from lm.weight_sync.integrity import WeightsRejected
from rollout_workers.agent_loop import AgentLoop, agent_group
from rollout_workers.config import RolloutConfig
from rollout_workers.data import Problem, PromptFormat, train_prompts
from rollout_workers.engines import make_engine
from rollout_workers.engines.base import Completion, GenerationEngine, SamplingParams
from rollout_workers.rewards import ERROR_CHARS, REWARD_ERROR, RewardRunner

log = logging.getLogger(__name__)


def group_seed(base: int, ticket: int) -> int:
    """The sampling seed of a ticket's group: the same for the same (base, ticket), so a run is
    reproducible and a reissued ticket draws the same samples if the weights have not changed;
    unrelated across base seeds (base + ticket x n, the rule before, gave run.seed=8 the samples of
    run.seed=0 one ticket on). 31 bits, leaving room for the engines' per-sample, per-continuation
    and per-turn offsets within a 64-bit seed."""
    digest = hashlib.blake2b(f"{base}:{ticket}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") >> 1


class StopRequested(Exception):
    """stop() was called while a generation was in flight."""


class WorkerNeedsRestart(RuntimeError):
    """The worker cannot go on in this process (its weights do not load, its engine serves
    nothing); the worker pool restarts the actor. The message says why."""


class RolloutWorker:
    def __init__(
        self,
        config: RolloutConfig | dict,
        worker_id: str,
        buffer_client=None,
        weight_store=None,
        engine: GenerationEngine | None = None,
    ) -> None:
        self.config = config if isinstance(config, RolloutConfig) else RolloutConfig.model_validate(config)
        if self.config.model_path is None and engine is None:
            raise ValueError("RolloutConfig.model_path is not set: the worker has no model to load")
        self.worker_id = worker_id
        self.client = buffer_client
        self.store = weight_store
        self.engine = engine
        self._owns_engine = engine is None
        self._stop = threading.Event()
        self._running = threading.Lock()
        # The loop's engine calls (a batch, a weight load) and an evaluation take turns: weights
        # never change in the middle of an evaluation, and an engine that runs one batch at a time
        # (transformers) is never called from two threads. Streaming requests need no turn.
        self._engine_turn = threading.RLock()
        self._setting_up = threading.Lock()  # `prepare` and `run` may come on two of the actor's threads
        self._setup_error: Exception | None = None  # what `prepare` met: `run` raises it
        self._known_version = -1
        # The last version the engine finished loading: what the worker's gauge shows, also while a
        # load is in flight (the engine says -1 then: its weights are a mix) and after it closed.
        self.served_version = -1
        self._subscription: WeightSubscription | None = None  # this process's end of the weight channel
        self._version_checked_at = 0.0
        self._started_at = time.time()
        self._recent_rewards: deque[float] = deque(maxlen=512)
        self.counters = dict(
            groups_total=0, samples_total=0, tokens_total=0, generation_s=0.0, gate_blocked_s=0.0,
            weight_load_s=0.0, weight_loads_total=0, failed_generations_total=0,
            interrupted_generations_total=0, permits_released_total=0, prompt_failures_total=0,
            prompts_quarantined_total=0, weight_load_failures_total=0, weight_loads_rejected_total=0,
            groups_refused_total=0, permits_refused_total=0, groups_filtered_total=0, uninformative_pushed_total=0,
        )
        self._filtered_in_a_row = 0  # rollout.filter_groups: groups left untrained since the last pushed
        self._warned_filter_metric = False
        self._probe_prompt: list[int] | None = None  # a prompt the engine served (the health probe)
        # Prompt positions this worker quarantined, with why: a later ticket for the same prompt (the
        # prompt set wraps around) is quarantined at once instead of failing again.
        self._bad_prompts: dict[int, str] = {}
        self.last_error = ""
        self.last_quarantine = ""  # "ticket N: why", for the run's console
        self.tokenizer = None
        self.prompt_format: PromptFormat | None = None
        self.prompts = None
        self.rewards: RewardRunner | None = None
        self._more_rewards: list[RewardRunner] = []  # the streaming loop's scorers beyond the first
        self.agent: AgentLoop | None = None  # multi-turn rollouts

    # ---------------------------------------------------------------- set-up

    def prepare(self) -> None:
        """Build the engine, tokenizer, prompts and rewards ahead of `run` (a run starts its workers'
        engines while its learner loads). Touches neither the buffer nor the weight channel. What
        fails is kept and raised by `run`, where the pool watches (this call's result is not read)."""
        try:
            self._ensure_started()
        except Exception as err:  # noqa: BLE001 - raised again by run()
            self._setup_error = err

    def _ensure_started(self) -> None:
        with self._setting_up:
            if self._setup_error is not None:
                err, self._setup_error = self._setup_error, None
                raise err
            self._set_up()

    def _set_up(self) -> None:
        cfg = self.config
        if self.engine is None:
            self.engine = make_engine(cfg.engine, cfg.model_path, seed=cfg.sampling.seed or 0)
        if hasattr(self.engine, "pause_mode"):  # how a weight load treats the requests in flight
            self.engine.pause_mode = "keep" if cfg.interrupt_on_update else "wait"
        self.served_version = max(self.served_version, int(self.engine.version))
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(cfg.model_path)
            self.prompt_format = PromptFormat.for_rollout(cfg.model_path, cfg, self.tokenizer)
        if self.prompts is None:
            self.prompts = train_prompts(cfg.task, self.prompt_format, cfg.sampling.max_new_tokens, cfg.rows_reward())
        if self.rewards is None and not cfg.multi_turn.enabled:
            self.rewards = RewardRunner.for_rollout(cfg)
        while not cfg.multi_turn.enabled and self._streams() and len(self._more_rewards) < cfg.reward_processes - 1:
            self._more_rewards.append(RewardRunner.for_rollout(cfg))
        if self.agent is None and cfg.multi_turn.enabled:
            self.agent = AgentLoop.for_rollout(cfg, self.tokenizer, self.prompt_format)

    def _sampling_params(self, ticket: int) -> SamplingParams:
        s = self.config.sampling
        stop = list(s.stop_token_ids)
        stop += [t for t in self.prompt_format.stop_token_ids if t not in stop]  # EOS, generation_config's
        seed = None if s.seed is None else group_seed(s.seed, ticket)
        return SamplingParams(
            n=s.n, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
            max_new_tokens=s.max_new_tokens, stop_token_ids=tuple(stop), seed=seed,
        )

    def _baseline_params(self, ticket: int) -> tuple[SamplingParams, ...]:
        """The group's greedy baseline request (rollout.greedy_baseline), else none."""
        if not self.config.greedy_baseline:
            return ()
        return (self._sampling_params(ticket).with_(n=1, temperature=0.0, seed=None),)

    # ---------------------------------------------------------------- weights

    def _store_version(self, max_age_s: float) -> int:
        now = time.monotonic()
        if now - self._version_checked_at >= max_age_s:
            self._known_version = int(call(self.store, "latest_version"))
            self._version_checked_at = now
        return self._known_version

    def _new_weights_waiting(self) -> bool:
        return self._store_version(self.config.weight_poll_s) > self._version_or_refused()

    def _version_or_refused(self) -> int:
        """The engine's version, or the newest version refused for good if that is newer: nothing
        up to it is worth interrupting a generation for."""
        refused = max(self._subscription.refused, default=-1) if self._subscription is not None else -1
        return max(int(self.engine.version), refused)

    def load_latest_weights(self) -> bool:
        """Bring the engine to the store's newest version if it is behind: load the live payload, or
        take part in the broadcast of it (waiting for it at most `weight_wait_s`). True if loaded."""
        if self._subscription is None:  # joins the weight channel: the next version waits for this worker
            self._subscription = WeightSubscription(self.store, self.worker_id, self.engine.version)
        if self._store_version(0.0) <= self._version_or_refused():
            return False
        started = time.perf_counter()
        try:
            with self._engine_turn:
                if self._subscription.receive(self.engine, self.config.weight_wait_s, self._stop) is None:
                    return False
        except WeightsRejected as err:
            # Refused by content (digest, NaN): the engine kept its weights, and its samples keep
            # the version it has. No retry here and no restart: a new process would load the same bytes.
            self.counters["weight_loads_rejected_total"] += 1
            self.last_error = f"weight load: {err}"
            return False
        self.counters["weight_load_s"] += time.perf_counter() - started
        self.counters["weight_loads_total"] += 1
        self.served_version = max(self.served_version, int(self.engine.version))
        return True

    def _acquire_wait_s(self) -> float:
        """How long one wait for permits may park this worker. A broadcast waits for every member to
        reach an interrupt point: parked, it reaches the next one within `weight_poll_s`."""
        if self._subscription is not None and self._subscription.pushed():
            return min(self.config.acquire_timeout_s, max(self.config.weight_poll_s, 0.05))
        return self.config.acquire_timeout_s

    def load_weights_or_restart(self) -> bool:
        """`load_latest_weights`, retried `weight_load_retries` times after a failure; then
        WorkerNeedsRestart. True if new weights were loaded."""
        retries = self.config.weight_load_retries
        for attempt in range(retries + 1):
            try:
                return self.load_latest_weights()
            except Exception as err:
                self.counters["weight_load_failures_total"] += 1
                self.last_error = f"weight load: {type(err).__name__}: {err}"
                log.warning("%s: loading weights failed (attempt %d of %d): %s", self.worker_id, attempt + 1,
                            retries + 1, self.last_error)
                if attempt == retries or self._stop.wait(self.config.error_backoff_s):
                    raise WorkerNeedsRestart(f"{self.worker_id}: the weights did not load in {attempt + 1} "
                                             f"attempt(s): {self.last_error}") from err
        return False

    def _wait_for_weights(self, version: int) -> None:
        """Load weights of at least `version`, waiting (bounded) for the learner to publish them."""
        wait_s = self.config.weight_wait_s
        deadline = time.monotonic() + wait_s
        while self.engine.version < version and not self._stop.is_set():
            if not self.load_weights_or_restart():
                refused = self._subscription.refused_newest() if self._subscription is not None else None
                if refused is not None:
                    log.warning("%s: generating with v%d, as %s", self.worker_id, self.engine.version, refused)
                    return
                if time.monotonic() > deadline:
                    log.warning("%s: weights v%d not published within %.0fs (rollout.weight_wait_s); generating "
                                "with v%d", self.worker_id, version, wait_s, self.engine.version)
                    return
                self._stop.wait(0.02)

    # ---------------------------------------------------------------- one group

    def _interrupt(self) -> bool:
        if self._stop.is_set():
            return True
        return self.config.interrupt_on_update and self._new_weights_waiting()

    def generate_groups(self, tickets: list[int]) -> list[Group]:
        """Generate, score and tag one group per ticket, all in one engine batch (no buffer involved)."""
        if self.agent is not None:
            return self._agent_groups(tickets)
        problems: list[Problem] = [self.prompts.problem(t) for t in tickets]
        prompts = [self.prompt_format.encode(p, self.config.sampling.max_new_tokens) for p in problems]
        requests = [(prompt, self._sampling_params(t)) for prompt, t in zip(prompts, tickets)]
        baselines = [(prompt, p) for prompt, t in zip(prompts, tickets) for p in self._baseline_params(t)]
        started_version = self.engine.version
        started = time.perf_counter()
        generated = self._generate_with_updates(requests + baselines)  # one engine batch
        if baselines:  # each group's greedy response after its samples, as a streamed group has it
            generated = [row + greedy for row, greedy in zip(generated, generated[len(requests):])]
        self.counters["generation_s"] += time.perf_counter() - started
        self._probe_prompt = prompts[0]
        return [
            self._make_group(ticket, problem, prompt, responses, started_version)
            for ticket, problem, prompt, responses in zip(tickets, problems, prompts, generated)
        ]

    def _make_group(self, ticket: int, problem: Problem, prompt_ids: list[int], responses, started_version: int,
                    rewards: RewardRunner | None = None) -> Group:
        """The group of `responses` (with rollout.greedy_baseline, the last is the greedy one: scored
        with the others, its reward each sample's reward_baseline, itself not trained on)."""
        texts = [self.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c, _ in responses]
        scored = (rewards or self.rewards).score(texts, problem)
        shaping = self.config.overlong_buffer  # DAPO's overlong penalty, on the greedy baseline's too
        penalties = [shaping.penalty(len(c.token_ids), self.config.sampling.max_new_tokens) for c, _ in responses]
        values = [reward.value + penalty for reward, penalty in zip(scored, penalties)]
        baseline = {}
        if self.config.greedy_baseline:
            baseline = {REWARD_BASELINE: float(values[-1])}
            responses, scored, values, penalties = responses[:-1], scored[:-1], values[:-1], penalties[:-1]
        # verl's metrics of it (means in the step's record)
        shaped = [{"reward/overlong_reward": penalty, "reward/overlong": float(penalty < 0)} if shaping.enabled else {}
                  for penalty in penalties]
        group_id = new_id()
        samples = [
            Sample(
                sample_id=new_id(), group_id=group_id,
                prompt_ids=np.asarray(prompt_ids, dtype=np.int32),
                response_ids=np.asarray(completion.token_ids, dtype=np.int32),
                rollout_log_probs=np.asarray(completion.log_probs, dtype=np.float32),
                loss_mask=np.ones(len(completion.token_ids), dtype=np.uint8),
                reward=value,
                weight_version=started_version,
                token_versions=np.asarray(versions, dtype=np.int32),
                routed_experts=completion.routed_experts,
                worker_id=self.worker_id,
                finish_reason=completion.finish_reason,
                metadata={"ticket": int(ticket), "family": problem.family, "difficulty": int(problem.difficulty),
                          **reward.metrics, **extra, **baseline,
                          **({REWARD_ERROR: reward.error[:ERROR_CHARS]} if reward.error else {})},
            )
            for (completion, versions), reward, value, extra in zip(responses, scored, values, shaped)
        ]
        self._recent_rewards.extend(values)
        self.counters["samples_total"] += len(samples)
        self.counters["tokens_total"] += sum(len(s.response_ids) for s in samples)
        return Group(group_id=group_id, samples=samples, prompt_index=int(ticket))

    def _agent_groups(self, tickets: list[int]) -> list[Group]:
        """One group of multi-turn trajectories per ticket, all advancing in one engine batch per turn."""
        requests = [(self.prompts.problem(t), self._sampling_params(t)) for t in tickets]
        started, env_s = time.perf_counter(), self.agent.envs.counters["env_seconds_total"]
        episodes = self.agent.run(requests, self._generate_with_updates, self._between_turns, self.engine.version)
        env_s = self.agent.envs.counters["env_seconds_total"] - env_s
        self.counters["generation_s"] += time.perf_counter() - started - env_s
        self._probe_prompt = episodes[0][0].prompt_ids
        groups = [agent_group(t, trajectories, self.worker_id) for t, trajectories in zip(tickets, episodes)]
        samples = [s for g in groups for s in g.samples]
        self._recent_rewards.extend(s.reward for s in samples)
        self.counters["samples_total"] += len(samples)
        self.counters["tokens_total"] += sum(int(s.loss_mask.sum()) for s in samples)  # generated tokens
        return groups

    def _between_turns(self) -> None:
        """Load new weights between two turns if the store has them (nothing is aborted)."""
        if self._stop.is_set():
            raise StopRequested()
        if self._new_weights_waiting():
            self.load_weights_or_restart()

    def _generate_with_updates(self, requests: list[tuple[list[int], SamplingParams]]):
        """For each request, its n completions with per-token weight versions. A generation
        interrupted by new weights (interrupt_on_update) is continued under the new weights."""
        version = self.engine.version
        with self._engine_turn:
            outputs = self.engine.generate_batch(requests, interrupt=self._interrupt)
        done = [[(c, [version] * len(c.token_ids)) for c in completions] for completions in outputs]
        while True:
            unfinished = [(r, i) for r, row in enumerate(done) for i, (c, _) in enumerate(row)
                          if c.finish_reason == "interrupted"]
            if not unfinished:
                return done
            if self._stop.is_set():
                raise StopRequested()
            self.counters["interrupted_generations_total"] += 1
            self.load_weights_or_restart()
            version = self.engine.version
            with self._engine_turn:
                more = self.engine.generate_batch(
                    [self._continuation(requests[r], done[r][i][0], i) for r, i in unfinished],
                    interrupt=self._interrupt)
            for (r, i), (extra,) in zip(unfinished, more):
                c, versions = done[r][i]
                # each part keeps the routing its weights chose (the interruption path of R3)
                routing = None if c.routed_experts is None or extra.routed_experts is None else \
                    np.concatenate([c.routed_experts, extra.routed_experts])
                merged = Completion(c.token_ids + extra.token_ids, c.log_probs + extra.log_probs, extra.finish_reason,
                                    routed_experts=routing)
                done[r][i] = (merged, versions + [version] * len(extra.token_ids))

    @staticmethod
    def _continuation(request: tuple[list[int], SamplingParams], partial: Completion, index: int):
        """Continue response `index` of `request` from its partial tokens (prompt + partial, n=1)."""
        prompt_ids, params = request
        left = max(params.max_new_tokens - len(partial.token_ids), 1)
        seed = None if params.seed is None else params.seed + params.n * (1 + len(partial.token_ids)) + index
        return prompt_ids + partial.token_ids, params.with_(n=1, max_new_tokens=left, seed=seed)

    # ---------------------------------------------------------------- the streaming loop

    def _streams(self) -> bool:
        return self.config.streaming and self.agent is None and getattr(self.engine, "streams", False)

    def _run_streaming(self, max_groups: int | None) -> None:
        """Keep the engine full: a permit's group goes in as soon as there is room (at most
        `max_requests_in_flight` responses), each group is scored as soon as its n responses end
        (in the reward runner, on a thread of its own: generation goes on meanwhile), and the groups
        scored so far are pushed together, the push taking the permits for the room left. New
        weights are loaded between two turns of this loop, the engine pausing its requests in flight
        (`interrupt_on_update`: at its next step, with mode=keep; else once they end, mode=wait):
        each token carries the version the engine sampled it with."""
        from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

        cfg = self.config
        per_group = cfg.sampling.n + sum(p.n for p in self._baseline_params(0))  # its samples and greedy baseline
        room_groups = max(1, cfg.max_requests_in_flight // per_group)
        generating: dict = {}  # GroupRequest -> (permit, problem, prompt, started version)
        scoring: dict = {}  # Future of a Group -> permit
        scored: list[tuple] = []  # (permit, group) ready to push
        waiting: list = []  # permits not submitted yet
        pushed, asked_at = 0, 0.0
        poll_s = max(cfg.weight_poll_s, 0.02)
        # One scoring thread per reward process: a group takes a free process for its n responses.
        import queue

        runners: queue.SimpleQueue = queue.SimpleQueue()
        for runner in [self.rewards, *self._more_rewards]:
            runners.put(runner)

        def score(*args):
            runner = runners.get()
            try:
                return self._make_group(*args, rewards=runner)
            finally:
                runners.put(runner)

        def room_for_permits(pushing: int = 0) -> int:
            """Permits to take now (`pushing`: groups being pushed, ending their permits). Groups
            generated faster than a slow reward scores them queue for a scorer: at most an engine's
            worth, so the permits held stay bounded (each is a group growing stale)."""
            held = len(generating) + len(scoring) + len(scored) + len(waiting)
            room = min(room_groups - len(generating) - len(waiting), 2 * room_groups - held)
            if max_groups is not None:
                room = min(room, max_groups - pushed - pushing - held)
            return room

        scorer = ThreadPoolExecutor(cfg.reward_processes, thread_name_prefix=f"{self.worker_id}-rewards")
        try:
            tick, busy = time.perf_counter(), False
            while not self._stop.is_set() and (max_groups is None or pushed < max_groups):
                now = time.perf_counter()
                self.counters["generation_s"] += (now - tick) if busy else 0.0  # wall time with requests in flight
                tick = now
                if self.load_weights_or_restart():
                    log.info("%s: loaded weights version %d", self.worker_id, self.engine.version)
                wanted = room_for_permits()
                if wanted > 0 and not scored:
                    idle = not generating and not scoring
                    if idle or time.monotonic() - asked_at >= poll_s:  # the gate may have opened
                        waiting += self._acquire_permits(wanted, wait=idle)
                        asked_at = time.monotonic()
                while waiting and len(generating) < room_groups and not self._stop.is_set():
                    permit = waiting.pop(0)
                    started = self._submit_group(permit)
                    if started is None:
                        continue  # set aside, or its prompt failed: the permit is ended
                    if isinstance(started, tuple) and started[0] == "made":
                        scored.append((permit, started[1]))
                    else:
                        generating[started[0]] = (permit, *started[1:])
                busy = bool(generating)
                for request in [r for r in generating if r.done()]:
                    permit, problem, prompt, version = generating.pop(request)
                    try:
                        responses = request.result()
                    except Exception as err:
                        group = self._recover_group(permit, err, served_others=pushed > 0 or bool(scored))
                        if group is not None:
                            scored.append((permit, group))
                        continue
                    self._probe_prompt = prompt
                    scoring[scorer.submit(score, permit.ticket, problem, prompt, responses, version)] = permit
                for future in [f for f in scoring if f.done()]:
                    permit = scoring.pop(future)
                    try:
                        scored.append((permit, future.result()))
                    except Exception as err:  # the runner scores failures itself: this is a bug's trace
                        self._release(permit.permit_id)
                        self.counters["failed_generations_total"] += 1
                        self.last_error = f"scoring: {type(err).__name__}: {err}"
                        log.warning("%s: ticket %d: %s", self.worker_id, permit.ticket, self.last_error)
                if scored:
                    made, scored = scored, []
                    room = room_for_permits(pushing=len(made))
                    done, more = self._push_streamed(made, 0 if self._stop.is_set() else max(room, 0))
                    pushed += done
                    waiting += more
                    continue
                if generating or scoring:
                    wait([r.future for r in generating] + list(scoring), timeout=poll_s, return_when=FIRST_COMPLETED)
        finally:
            for request in generating:
                request.cancel()  # aborts its requests
            for future in scoring:
                future.cancel()
            scorer.shutdown(wait=True)
            self._release_all([permit for permit, *_ in generating.values()] + list(scoring.values())
                              + [permit for permit, _ in scored] + waiting)

    def _acquire_permits(self, count: int, wait: bool = True) -> list:
        """Up to `count` permits in one request: waiting for the first (`wait`: the batch loop, or
        the streaming loop with nothing in flight), else only those free now (the streaming loop
        has work to tend). Empty when the buffer's per-client cap (limits.per_client.max_permits,
        below this worker's room) refuses more: the loop goes on with what it holds."""
        waited = time.perf_counter()
        try:
            permits = self.client.acquire_permits(self.worker_id, count,
                                                  timeout=self._acquire_wait_s() if wait else 0.0)
        except BufferError as err:
            if err.reason != "too_many_permits":
                raise
            self.counters["permits_refused_total"] += 1
            if wait:  # holding nothing it knows of: permits whose replies were lost, until their leases end
                self._stop.wait(self._acquire_wait_s())
            permits = []
        if wait:
            self.counters["gate_blocked_s"] += time.perf_counter() - waited
        return permits

    def _submit_group(self, permit):
        """Start a permit's group on the engine: (request, problem, prompt, version); ("made", group)
        when the engine refused it at once and a retry alone made it; None when the permit is ended
        (its prompt set aside, or failing). A permit granted at learner version v needs weights >= v
        (as in the batch loop)."""
        self._wait_for_weights(permit.version)
        held = [permit]
        self._set_aside_known_bad(held)
        if not held:
            return None
        problem = self.prompts.problem(permit.ticket)
        prompt = self.prompt_format.encode(problem, self.config.sampling.max_new_tokens)
        try:
            version = self.engine.version
            request = self.engine.submit(prompt, self._sampling_params(permit.ticket), *self._baseline_params(permit.ticket))
            return request, problem, prompt, version
        except Exception as err:  # refused before it went in (a prompt past the context, ...)
            group = self._recover_group(permit, err, served_others=self._probe_prompt is not None)
            return None if group is None else ("made", group)

    def _recover_group(self, permit, error: Exception, served_others: bool):
        """A streamed group failed: its request was its prompt's alone, so this is the prompt's
        first failure. It is generated again alone (batch path) up to `max_prompt_failures` failures,
        then quarantined (or the engine, serving nothing, needs a restart). The group, or None
        (the permit is ended)."""
        self.counters["prompt_failures_total"] += 1
        failures = 1
        log.warning("%s: ticket %d failed (%s: %s); generating it alone", self.worker_id, permit.ticket,
                    type(error).__name__, error)
        while failures < self.config.max_prompt_failures:
            if self._stop.is_set():
                self._release(permit.permit_id)
                return None
            group, retry_error = self._generate_alone(permit)
            if group is not None:
                return group
            error, failures = retry_error, failures + 1
        try:
            self._quarantine_or_restart(permit, error, engine_served_others=served_others)
        except BaseException:
            self._release(permit.permit_id)  # a restart: the permit is back first
            raise
        return None

    def _push_streamed(self, made: list[tuple], next_count: int) -> tuple[int, list]:
        """Push the scored groups in one request, taking up to `next_count` permits with it.
        (groups pushed, new permits); a failed push releases their permits. Uninformative groups
        are not pushed (`_filter_uninformative`)."""
        try:
            made = self._filter_uninformative(made)
            if not made:
                return 0, []
            try:
                _, next_permits = self.client.push_and_acquire([g for _, g in made], [p.permit_id for p, _ in made],
                                                               self.worker_id, next_count)
            except BufferError as err:
                if err.reason not in GROUP_REFUSALS:
                    raise
                made, next_permits = self._push_alone(made, err), []
        except Exception as err:
            self._release_all([permit for permit, _ in made])
            self.counters["failed_generations_total"] += 1
            self.last_error = f"push: {type(err).__name__}: {err}"
            log.warning("%s: pushing tickets %s failed: %s", self.worker_id, [p.ticket for p, _ in made],
                        self.last_error)
            self._stop.wait(self.config.error_backoff_s)
            return 0, []
        self.counters["groups_total"] += len(made)
        return len(made), next_permits

    # ---------------------------------------------------------------- the loop

    def run(self, max_groups: int | None = None) -> dict:
        """Loop until stop() (or at least `max_groups` pushed groups); returns the final stats."""
        with self._running:
            self._ensure_started()
            self._started_at = time.time()  # rates count from the first generation, not start-up
            if self._streams():
                self._run_streaming(max_groups)
                return self.stats()
            pushed, permits = 0, []
            try:
                while not self._stop.is_set() and (max_groups is None or pushed < max_groups):
                    if self.load_weights_or_restart():
                        log.info("%s: loaded weights version %d", self.worker_id, self.engine.version)
                    # a request of its own only when the last push brought none (gate closed, or at start)
                    permits = permits or self._acquire_permits(self.config.groups_per_batch)
                    if permits:
                        more = self.config.groups_per_batch  # permits to take with the push
                        if max_groups is not None:
                            more = min(more, max_groups - pushed - len(permits))
                        batch, permits = permits, []  # _run_permits owns them now
                        done, permits = self._run_permits(batch, more)
                        pushed += done
            finally:
                self._release_all(permits)  # taken with the last push, never generated
            return self.stats()

    def run_in_actor(self, buffer_client, weight_store) -> dict:
        """`run()` as a Ray actor's task: a worker that needs a restart ends its process, and Ray
        restarts the actor as after a crash (its permits are already back; the restart counts
        against the pool's budget). In-process callers use `run()`, which raises instead. The
        buffer client and the weight store come with the task, not the constructor: actor handles
        among a restartable actor's constructor arguments would live in the object store (Ray
        warns that such an actor may fail to restart)."""
        self.client, self.store = buffer_client, weight_store
        try:
            return self.run()
        except WorkerNeedsRestart as exc:
            log.error("%s; ending this process so that Ray restarts the worker", exc)
            logging.shutdown()
            os._exit(70)

    def _run_permits(self, permits: list, next_count: int) -> tuple[int, list]:
        """Generate and push a group per permit; the push also takes up to `next_count` permits
        for the next engine batch (`push_and_acquire`: one request per batch while the gate is
        open). Returns (groups pushed, next permits). Every permit not consumed by a push is
        released (or its prompt quarantined)."""
        held = list(permits)  # permits this call still has to end
        try:
            # A permit granted at learner version v needs weights >= v (the gate moves to v just
            # before v is published): else its samples start stale and, at η = 0, are all dropped.
            self._wait_for_weights(max(p.version for p in permits))
            self._set_aside_known_bad(held)
            made = self._filter_uninformative(self._generate_isolating(held) if held else [], held)
            if not made:
                return 0, []
            count = 0 if self._stop.is_set() else next_count
            try:
                _, next_permits = self.client.push_and_acquire([g for _, g in made], [p.permit_id for p, _ in made],
                                                               self.worker_id, count)  # the push is all or nothing
            except BufferError as err:
                if err.reason not in GROUP_REFUSALS:
                    raise
                made, next_permits = self._push_alone(made, err), []
            held = [p for p in held if all(p is not q for q, _ in made)]
            self.counters["groups_total"] += len(made)
            return len(made), next_permits
        except BaseException as err:
            self._release_all(held)
            if isinstance(err, StopRequested):
                return 0, []
            if not isinstance(err, Exception) or isinstance(err, WorkerNeedsRestart):
                raise  # KeyboardInterrupt, SystemExit, a restart: the permits are back, now go
            self.counters["failed_generations_total"] += 1
            self.last_error = f"{type(err).__name__}: {err}"
            log.warning("%s: tickets %s failed: %s", self.worker_id, [p.ticket for p in held], self.last_error)
            self._stop.wait(self.config.error_backoff_s)
        return 0, []

    def _generate_isolating(self, held: list) -> list[tuple]:
        """(permit, group) for the permits whose groups were made. If the engine batch fails, each
        prompt is generated on its own; one that still fails is retried alone up to
        `max_prompt_failures` times, then quarantined if the engine serves other prompts (else the
        engine is at fault: WorkerNeedsRestart). Ended permits leave `held`."""
        try:
            return list(zip(held, self.generate_groups([p.ticket for p in held])))
        except StopRequested:
            raise
        except Exception as err:
            batch_error = err
        log.warning("%s: the engine batch of tickets %s failed (%s: %s); generating each prompt alone",
                    self.worker_id, [p.ticket for p in held], type(batch_error).__name__, batch_error)
        alone = len(held) == 1  # the batch was this prompt alone: that failure counts too
        made, failing = [], []
        for permit in held:
            group, error = self._generate_alone(permit)
            if group is not None:
                made.append((permit, group))
            else:
                failing.append((permit, error))
        for permit, error in failing:
            failures = 1 + alone
            while failures < self.config.max_prompt_failures:
                group, error = self._generate_alone(permit)
                if group is not None:
                    made.append((permit, group))
                    break
                failures += 1
            else:
                self._quarantine_or_restart(permit, error, engine_served_others=bool(made))
                held.remove(permit)
        return made

    def _push_alone(self, made: list[tuple], err: BufferError) -> list[tuple]:
        """After a push refused for a group's content: each group pushed on its own, so its
        batch-mates are accepted; a group refused again is quarantined like a prompt the engine
        fails (it would be generated and refused forever). Returns the (permit, group) pairs pushed;
        the others' permits are ended by the quarantine (a later release of them is a no-op)."""
        log.warning("%s: the push of tickets %s was refused (%s); pushing each group alone", self.worker_id,
                    [p.ticket for p, _ in made], err)
        ended = []
        for permit, group in made:
            try:
                self.client.push_group(group, permit.permit_id)
            except BufferError as refused:
                if refused.reason not in GROUP_REFUSALS:
                    raise
                reason = f"group refused by the buffer: {refused}"
                log.error("%s: ticket %d quarantined, its group %s: %s", self.worker_id, permit.ticket,
                          group.group_id, refused)
                self._quarantine(permit, reason)
                self.counters["groups_refused_total"] += 1
                continue
            ended.append((permit, group))
        return ended

    def _filter_uninformative(self, made: list[tuple], held: list | None = None) -> list[tuple]:
        """Dynamic sampling (rollout.filter_groups): the (permit, group) pairs to push. A group of
        two or more samples whose metric is the same for all is not pushed: its permit ends with
        `filter_group` (and leaves `held`), unless `max_in_a_row` groups were filtered in a row. A
        group with a sample that lacks the metric (a reward that failed returns none) is pushed."""
        rule = self.config.filter_groups
        if not rule.enabled:
            return made
        kept = []
        for permit, group in made:
            values = {self._filter_value(s, rule.metric) for s in group.samples}
            if None in values and not self._warned_filter_metric:
                self._warned_filter_metric = True
                log.warning("%s: rollout.filter_groups.metric=%r is missing from a sample of ticket %d (it has %s): "
                            "such groups are pushed unfiltered", self.worker_id, rule.metric, permit.ticket,
                            sorted({k for s in group.samples for k in s.metadata}))
            if len(group.samples) < 2 or len(values) > 1 or None in values:
                self._filtered_in_a_row = 0
                kept.append((permit, group))
                continue
            if self._filtered_in_a_row >= rule.max_in_a_row:
                self.counters["uninformative_pushed_total"] += 1
                log.warning("%s: %d groups in a row scored alike (rollout.filter_groups.max_in_a_row); pushing "
                            "ticket %d's anyway: does the policy solve every prompt, or none?", self.worker_id,
                            self._filtered_in_a_row, permit.ticket)
                self._filtered_in_a_row = 0
                kept.append((permit, group))
                continue
            (value,) = values
            self.client.filter_group(permit.permit_id, f"all {len(group.samples)} samples scored {rule.metric} "
                                                      f"= {value:g}")
            self.counters["groups_filtered_total"] += 1
            self._filtered_in_a_row += 1
            if held is not None:
                held.remove(permit)
        return kept

    @staticmethod
    def _filter_value(sample, metric: str) -> float | None:
        if metric == "reward":
            return float(sample.reward)
        # a reward's own metrics ride as reward/<key>: verl's name ('acc') or that one
        value = sample.metadata.get(metric, sample.metadata.get(f"reward/{metric}"))
        try:
            return float(value)
        except (TypeError, ValueError):  # absent, or not a number
            return None

    def _set_aside_known_bad(self, held: list) -> None:
        """Quarantine at once the permits whose prompt this worker quarantined before."""
        for permit in [p for p in held if self._prompt_position(p.ticket) in self._bad_prompts]:
            reason = self._bad_prompts[self._prompt_position(permit.ticket)]
            self.client.release_permit(permit.permit_id, quarantine=f"ticket {permit.ticket}: {reason}")
            self.counters["prompts_quarantined_total"] += 1
            held.remove(permit)

    def _prompt_position(self, ticket: int) -> int:
        return self.prompts.position(ticket)

    def _generate_alone(self, permit) -> tuple:
        """(group, None), or (None, the engine's error) for one prompt on its own."""
        try:
            return self.generate_groups([permit.ticket])[0], None
        except StopRequested:
            raise
        except Exception as err:
            self.counters["prompt_failures_total"] += 1
            return None, err

    def _quarantine_or_restart(self, permit, error: Exception, engine_served_others: bool) -> None:
        """Quarantine a prompt that failed `max_prompt_failures` times on its own, once the engine
        is known to serve other prompts; an engine that serves nothing needs a restart."""
        reason = f"{type(error).__name__}: {error}"
        if not (engine_served_others or self._engine_serves_a_probe()):
            raise WorkerNeedsRestart(f"{self.worker_id}: the engine fails every prompt, the last one ticket "
                                     f"{permit.ticket}: {reason}") from error
        log.error("%s: ticket %d quarantined after %d failed generations on its own (its prompt is never "
                  "reissued): %s", self.worker_id, permit.ticket, self.config.max_prompt_failures, reason)
        self._quarantine(permit, reason)

    def _quarantine(self, permit, reason: str) -> None:
        """Set the permit's ticket aside for good (the buffer never reissues it; this worker sets its
        prompt aside at once if the prompt set wraps around to it), counted and remembered with why."""
        why = f"ticket {permit.ticket}: {reason}"
        self.client.release_permit(permit.permit_id, quarantine=why)
        self.last_quarantine = why
        self.counters["prompts_quarantined_total"] += 1
        self._bad_prompts[self._prompt_position(permit.ticket)] = reason
        self.last_error = reason

    def _engine_serves_a_probe(self) -> bool:
        """Whether the engine generates one token for a prompt it served before (or, before it
        served any, for a one-token prompt: a streaming worker's first groups end in any order)."""
        prompt = self._probe_prompt
        if prompt is None:
            if not self._streams():
                return False
            prompt = list(self.prompt_format.stop_token_ids[:1]) or [0]
        probe = SamplingParams(n=1, temperature=1.0, max_new_tokens=1, seed=0)
        try:
            with self._engine_turn:
                self.engine.generate_batch([(prompt, probe)])
            return True
        except Exception:
            return False

    def _release(self, permit_id: str) -> bool:
        """Hand a permit back; False when the buffer did not answer (it reclaims the permit when
        its lease runs out)."""
        try:
            self.client.release_permit(permit_id)
            self.counters["permits_released_total"] += 1
            return True
        except Exception as err:  # the buffer will reclaim it when its lease runs out
            log.warning("%s: could not release permit %s: %s", self.worker_id, permit_id, err)
            return not isinstance(err, BufferUnavailable)

    def _release_all(self, permits) -> None:
        """Hand back the permits a loop holds as it ends. Once the buffer does not answer, the rest
        are left to their leases: each call would wait out its timeout and retries on a buffer that
        is gone (a run that lost its buffer took that long to stop)."""
        for permit in permits:
            if not self._release(permit.permit_id):
                break

    def stop(self, timeout: float | None = None) -> bool:
        """Ask run() to finish: an in-flight generation is interrupted and its permit released.
        Returns whether run() has returned (within `timeout`)."""
        self._stop.set()
        acquired = self._running.acquire(timeout=-1 if timeout is None else timeout)
        if acquired:
            self._running.release()
        return acquired

    def close(self) -> None:
        self.stop()
        for runner in [self.rewards, *self._more_rewards]:
            if runner is not None:
                runner.close()
        if self.agent is not None:
            self.agent.close()
        if self._owns_engine and self.engine is not None:
            self.engine.close()
            self.engine = None

    def stats(self) -> dict:
        c = dict(self.counters)
        elapsed = max(time.time() - self._started_at, 1e-9)
        c.update(
            worker_id=self.worker_id,
            loaded_version=self.served_version,
            tokens_per_s=c["tokens_total"] / c["generation_s"] if c["generation_s"] > 0 else 0.0,
            groups_per_s=c["groups_total"] / elapsed,
            reward_mean=float(np.mean(self._recent_rewards)) if self._recent_rewards else 0.0,
            last_error=self.last_error,
            last_quarantine=self.last_quarantine,
        )
        pause_s = getattr(self.engine, "pause_s_total", None)
        if pause_s is not None:  # time weight loads held the engine paused (vLLM)
            c["engine_pause_s"] = float(pause_s)
        device = getattr(self.engine, "device", None)  # an engine in this process (transformers); vLLM's is not
        if device is not None:
            c.update({f"gpu_{k}_bytes": v for k, v in gpu_memory_peaks(device).items()})
        if self.rewards is not None:
            c.update(self.rewards.stats())
            for runner in self._more_rewards:
                for key, value in runner.stats().items():
                    c[key] = c.get(key, 0) + value
        if self.agent is not None:
            c.update(self.agent.stats())
        return c

    # ---------------------------------------------------------------- held-out evaluation on this engine
    # Self-contained on purpose (services/evaluation.py drives it; its metrics are computed there):
    # evaluation needs no GPU of its own and never runs inside the learner's step.

    def evaluate_heldout(self, spec: dict) -> dict:
        """Greedy and sampled answers to the run's held-out prompts on this worker's engine, scored,
        at one weight version: the whole evaluation holds the engine's turn (`_engine_turn`), so no
        new weights arrive in the middle of it. Waits (at most spec["wait_s"]) for
        the engine to exist and to have loaded spec["min_version"]; an engine still behind then is
        evaluated as it is (the version is reported). `spec`: num_prompts, seed, n_samples,
        temperature, max_new_tokens, min_version, wait_s. Returns the version, per-prompt rewards
        (greedy; n_samples sampled) and data sources, reward failures and timeouts, seconds, and for multi-turn
        tasks the greedy episodes' environment info and turns."""
        from rollout_workers.data import heldout_problems

        deadline = time.monotonic() + spec["wait_s"]
        while (self.engine is None or self.prompt_format is None) and time.monotonic() < deadline:
            time.sleep(0.05)  # the loop builds the engine on its first call
        if self.engine is None or self.prompt_format is None:
            raise TimeoutError(f"{self.worker_id}: no engine after {spec['wait_s']:.0f}s: nothing to evaluate on")
        while self.engine.version < spec["min_version"] and time.monotonic() < deadline:
            time.sleep(0.05)  # the loop loads new weights between its generations
        engine, cfg = self.engine, self.config
        with self._engine_turn:
            started, version = time.perf_counter(), int(engine.version)
            key = (spec["num_prompts"], spec["seed"], spec["max_new_tokens"])
            if self.__dict__.get("_eval_prompts_key") != key:
                problems = heldout_problems(cfg.task, spec["num_prompts"], spec["seed"], self.prompt_format,
                                            spec["max_new_tokens"], cfg.rows_reward())
                self._eval_prompts = [(p, self.prompt_format.encode(p, spec["max_new_tokens"])) for p in problems]
                self._eval_prompts_key = key
            prompts = self._eval_prompts
            stop = tuple(self.prompt_format.stop_token_ids)
            greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=spec["max_new_tokens"],
                                    stop_token_ids=stop, seed=spec["seed"])
            sampled = greedy.with_(n=spec["n_samples"], temperature=spec["temperature"], seed=spec["seed"] + 1) \
                if spec["n_samples"] else None
            out = {"version": version, "env": {}, "turns_mean": None, "sources": [p.data_source for p, _ in prompts]}
            if cfg.multi_turn.enabled:  # episodes of the agent loop, scored by their environment
                if self.__dict__.get("_eval_agent") is None:
                    import weakref

                    self._eval_agent = AgentLoop.for_rollout(cfg, self.tokenizer, self.prompt_format)
                    weakref.finalize(self, self._eval_agent.close)

                def generate(requests):
                    return [[(c, [version] * len(c.token_ids)) for c in row] for row in engine.generate_batch(requests)]

                rows = {}
                for name, params in (("greedy", greedy), ("sampled", sampled)):
                    if params is not None:
                        rows[name] = self._eval_agent.run([(p, params) for p, _ in prompts], generate, version=version)
                out["greedy"] = [row[0].reward for row in rows["greedy"]]
                out["sampled"] = [[e.reward for e in row] for row in rows["sampled"]] if sampled else None
                firsts = [row[0] for row in rows["greedy"]]
                keys = sorted({k for e in firsts for k in e.info})
                out["env"] = {k: float(np.mean([e.info.get(k, 0.0) for e in firsts])) for k in keys}
                out["turns_mean"] = float(np.mean([e.turns for e in firsts]))
                failures = timeouts = 0
            else:  # one engine call: greedy and sampled requests together, at one version
                if self.__dict__.get("_eval_rewards") is None:  # its own reward process: the loop's is busy
                    import weakref

                    self._eval_rewards = RewardRunner.for_rollout(cfg)
                    weakref.finalize(self, self._eval_rewards.close)
                rewards, before = self._eval_rewards, dict(self._eval_rewards.stats())
                requests = [(ids, greedy) for _, ids in prompts] + ([(ids, sampled) for _, ids in prompts]
                                                                    if sampled else [])
                rows = engine.generate_batch(requests)

                def score(problem, completions):
                    texts = [self.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in completions]
                    return [s.value for s in rewards.score(texts, problem)]

                out["greedy"] = [score(p, row)[0] for (p, _), row in zip(prompts, rows[:len(prompts)])]
                out["sampled"] = [score(p, row) for (p, _), row in zip(prompts, rows[len(prompts):])] \
                    if sampled else None
                after = rewards.stats()
                failures = after.get("reward_failures_total", 0) - before.get("reward_failures_total", 0)
                timeouts = after.get("reward_timeouts_total", 0) - before.get("reward_timeouts_total", 0)
            out.update(reward_failures=float(failures), reward_timeouts=float(timeouts),
                       seconds=time.perf_counter() - started)
            return out
