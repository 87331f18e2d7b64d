"""The tiny-model kit: a character tokenizer trained locally with `tokenizers`, a small Qwen2-style
causal LM built from a config, and a short supervised warm start on the built-in tasks, saved as
an ordinary HF folder (loaded by `lm.causal_lm.load_causal_lm`, by transformers and by vLLM).
`num_experts > 0` (`run.model: tiny-moe`, `TinyModelSpec.moe`) builds a Qwen3-MoE instead: the
same tokenizer, attention and warm start, every MLP a top-k routed mixture of experts.

The tokenizer carries a small chat template (two added special tokens mark the turns; the end of
a turn is EOS), so chat-formatted prompts work end to end with the tiny model too; the warm start
never sees them, so the built-in tasks' model is the same with or without them.

The warm start is deliberately short: RL should start from a policy that solves some held-out
prompts but not all, so there is reward signal and room to improve.
`ensure_tiny_model(cache_dir)` builds once per spec (the cache key is a hash of the spec) and
reuses the folder afterwards; concurrent builders wait on a file lock.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
import shutil
import time
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field

from rollout_workers.data import ALPHABET, Problem, mixed_problems

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
USER, ASSISTANT = "<|user|>", "<|assistant|>"  # turn markers of the chat template (appended to the vocab)
# System and user turns both open with USER; a turn ends with EOS; the generation prompt is ASSISTANT.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ ('<|assistant|>' if message['role'] == 'assistant' else '<|user|>') + message['content'] + eos_token }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>' }}{%- endif -%}"
)
# The calculator tool's markers (rollout_workers.environments.calculator), added as single tokens
# to the tokenizer of a model warm-started on tool transcripts: `</calc>` ends a turn.
TOOL_TOKENS = ("<calc>", "</calc>", "<r>", "</r>")
SPEC_FILE = "etarl_tiny_model.json"
BUILD_VERSION = 2  # bump when the build recipe changes, so old caches are not reused (2: the chat template)


class TinyModelSpec(BaseModel):
    """Everything that decides the built folder; its hash is the cache key."""

    model_config = ConfigDict(extra="forbid")

    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4  # head_dim 32: the smallest head size vLLM's CPU attention supports
    num_kv_heads: int = 2
    intermediate_size: int = 512
    max_positions: int = 64
    families: list[str] = ["add"]
    difficulties: list[int] = [1, 2, 3]
    warm_start_steps: int = 750
    batch_size: int = 64
    learning_rate: float = 3e-3
    seed: int = 0
    tool_transcripts: float = Field(
        0.0, ge=0.0, le=1.0, description="fraction of warm-start examples that are calculator tool transcripts "
        "(the rest answer directly); > 0 adds the tool tokens to the tokenizer")
    num_experts: int = Field(0, ge=0, le=256, description="0: a dense Qwen2; > 0: a Qwen3-MoE with this many "
                             "experts per layer (expert ids fit the routing field's uint8)")
    experts_per_token: int = Field(2, ge=1, description="MoE: the router's top-k")
    expert_intermediate_size: int = Field(128, ge=1, description="MoE: each expert's MLP width")
    router_aux_loss_coef: float = Field(0.001, ge=0, description="MoE: the load-balancing loss's weight in "
                                        "the warm start (Qwen3-MoE's default; RL adds none)")

    def cache_key(self) -> str:
        # A spec without tool transcripts (or experts) hashes as it did before the field existed (same folder).
        exclude = set() if self.tool_transcripts else {"tool_transcripts"}
        if not self.num_experts:
            exclude |= {"num_experts", "experts_per_token", "expert_intermediate_size", "router_aux_loss_coef"}
        fields = self.model_dump(exclude=exclude)
        blob = json.dumps({"build": BUILD_VERSION, **fields}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    def moe(self) -> "TinyModelSpec":
        """This spec as a mixture of experts (8 experts, top-2, unless it already has experts)."""
        if self.num_experts:
            return self
        if self.experts_per_token > 8:
            raise ValueError(f"experts_per_token={self.experts_per_token} exceeds the 8 experts of tiny-moe")
        return self.model_copy(update={"num_experts": 8})


def build_tokenizer(tool_tokens: bool = False):
    """A character-level WordLevel tokenizer trained on task text, as a PreTrainedTokenizerFast,
    with the turn markers appended after the characters (so their ids come last) and a chat
    template; `tool_tokens` appends TOOL_TOKENS as ordinary (not special) added tokens, so decoding
    keeps them."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    trainer = trainers.WordLevelTrainer(special_tokens=[PAD, EOS, UNK], min_frequency=1)
    corpus = [ALPHABET] + [p.prompt + p.answer for p in mixed_problems(["add", "reverse"], [1, 2], "train", 200)]
    tok.train_from_iterator(corpus, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK,
                                        additional_special_tokens=[USER, ASSISTANT])
    tokenizer.chat_template = CHAT_TEMPLATE
    if tool_tokens:
        tokenizer.add_tokens(list(TOOL_TOKENS))
    return tokenizer


def build_model(spec: TinyModelSpec, vocab_size: int, tokenizer):
    """The random policy of `spec`: Qwen2, or Qwen3-MoE when the spec has experts."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        torch_dtype="float32",
    )
    if spec.num_experts:
        from transformers import Qwen3MoeConfig as Config, Qwen3MoeForCausalLM as Model

        if spec.experts_per_token > spec.num_experts:
            raise ValueError(f"experts_per_token={spec.experts_per_token} exceeds num_experts={spec.num_experts}")
        config = Config(
            **common,
            moe_intermediate_size=spec.expert_intermediate_size,
            head_dim=spec.hidden_size // spec.num_heads,  # Qwen3 sets it apart (default 128)
            num_experts=spec.num_experts,
            num_experts_per_tok=spec.experts_per_token,
            norm_topk_prob=True,  # as Qwen3-30B-A3B: the top-k gate weights sum to 1
            router_aux_loss_coef=spec.router_aux_loss_coef,
        )
    else:
        from transformers import Qwen2Config as Config, Qwen2ForCausalLM as Model

        config = Config(**common)
    torch.manual_seed(spec.seed)
    return Model(config)


def encode_problem(tokenizer, problem: Problem) -> tuple[list[int], list[int]]:
    """Prompt ids and target ids (answer + EOS), the same way the workers and the warm start see them."""
    prompt = tokenizer(problem.prompt, add_special_tokens=False)["input_ids"]
    answer = tokenizer(problem.answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return prompt, answer


def tool_transcript(tokenizer, problem: Problem) -> tuple[list[int], list[int]]:
    """Ids and labels (-100: no loss) of a calculator episode: the policy's call and answer are
    learned, the prompt and the calculator's reply are not."""
    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    prompt, answer = encode_problem(tokenizer, problem)
    call = ids(f"<calc>{problem.prompt.rstrip('=')}</calc>")
    reply = ids(f"<r>{problem.answer}</r>")
    return prompt + call + reply + answer, [-100] * len(prompt) + call + [-100] * len(reply) + answer


def direct_answer(tokenizer, problem: Problem) -> tuple[list[int], list[int]]:
    prompt, answer = encode_problem(tokenizer, problem)
    return prompt + answer, [-100] * len(prompt) + answer


def _sft_batch(tokenizer, examples: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, ...]:
    width = max(len(x) for x, _ in examples)
    ids = torch.full((len(examples), width), tokenizer.pad_token_id, dtype=torch.long)
    attention = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for row, (x, y) in enumerate(examples):
        ids[row, : len(x)] = torch.tensor(x)
        attention[row, : len(x)] = 1
        labels[row, : len(y)] = torch.tensor(y)
    return ids, attention, labels


def warm_start(model, tokenizer, spec: TinyModelSpec, log=print) -> None:
    """A few hundred supervised steps on train problems: enough to learn the format and part of the
    task. With tool_transcripts, that fraction of the examples are calculator episodes."""
    problems = mixed_problems(spec.families, spec.difficulties, "train", 20000, seed=spec.seed)
    rng = random.Random(spec.seed)
    tool_rng = random.Random(f"{spec.seed}:tools")  # its own stream: the draws of problems stay the same

    def example(problem: Problem):
        use_tool = spec.tool_transcripts and tool_rng.random() < spec.tool_transcripts
        return (tool_transcript if use_tool else direct_answer)(tokenizer, problem)

    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / 20) * max(0.1, 1 - step / spec.warm_start_steps)
    )
    model.train()
    for step in range(spec.warm_start_steps):
        ids, attention, labels = _sft_batch(tokenizer, [example(p) for p in rng.sample(problems, spec.batch_size)])
        # MoE: the load-balancing loss joins the LM loss (output_router_logits), as the architecture
        # trains; without it the router collapses onto few experts.
        moe = {"output_router_logits": True} if spec.num_experts else {}
        loss = model(input_ids=ids, attention_mask=attention, labels=labels, **moe).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == spec.warm_start_steps - 1:
            log(f"warm start step {step}: loss {loss.item():.3f}")
    model.eval()


@torch.no_grad()
def greedy_accuracy(model, tokenizer, problems: list[Problem], max_new_tokens: int = 8) -> float:
    """Fraction of problems whose greedy answer matches the reference exactly (transformers generate)."""
    correct = 0
    for problem in problems:
        prompt, _ = encode_problem(tokenizer, problem)
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        text = tokenizer.decode(out[0, len(prompt) :], skip_special_tokens=True)
        correct += int(text.strip() == problem.answer)
    return correct / len(problems)


def _save_quietly(model, folder: Path) -> None:
    """save_pretrained without its "Writing model shards" bar (one shard of a few MB: noise on the
    first run's screen)."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(folder, safe_serialization=True)
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def build_threads(spec: TinyModelSpec) -> int:
    """A dense build's threads: OMP_NUM_THREADS where it is set (processes that share the cores,
    such as the test suite's, set 1), else every core this process may use: a run builds before
    anything else of it starts. On 2 idle cores 100 steps took 11.8 s on two threads against
    13.5 s on one, the same weights bit for bit (as with 4, 8 or 16 threads: 30 steps compared);
    beside one busy process 24.8 s, and two such builds at once 72 s each (OpenMP threads spin on
    cores that are not free). A mixture of experts builds on one thread: its expert dispatch sums
    in an order that follows the thread count, and so builds the same model on any machine."""
    if spec.num_experts:
        return 1
    pinned = os.environ.get("OMP_NUM_THREADS", "")
    return int(pinned) if pinned.isdigit() and int(pinned) > 0 else len(os.sched_getaffinity(0))


class _BuildThreads:
    """torch on build_threads(spec) threads for the build, then back to its setting."""

    def __init__(self, spec: TinyModelSpec):
        self.threads = build_threads(spec)

    def __enter__(self):
        self.before = torch.get_num_threads()
        torch.set_num_threads(self.threads)

    def __exit__(self, *exc):
        torch.set_num_threads(self.before)


def build_tiny_model(folder: str | os.PathLike, spec: TinyModelSpec | None = None, log=print) -> Path:
    """Build, warm-start and save the tiny model folder (tokenizer included) at `folder`."""
    spec = spec or TinyModelSpec()
    with _BuildThreads(spec):
        return _build(Path(folder), spec, log)


def _build(folder: Path, spec: TinyModelSpec, log) -> Path:
    started = time.perf_counter()
    tokenizer = build_tokenizer(tool_tokens=spec.tool_transcripts > 0)
    vocab = len(tokenizer)
    model = build_model(spec, vocab_size=-(-vocab // 16) * 16, tokenizer=tokenizer)
    warm_start(model, tokenizer, spec, log=log)
    accuracy = {
        f"{family}/{difficulty}": greedy_accuracy(
            model, tokenizer, mixed_problems([family], [difficulty], "heldout", 60, seed=spec.seed)
        )
        for family in spec.families
        for difficulty in spec.difficulties
    }
    log(f"tiny model: held-out greedy accuracy {accuracy} after {spec.warm_start_steps} steps")
    _save_quietly(model, folder)
    tokenizer.save_pretrained(folder)
    record = {
        "spec": spec.model_dump(),
        "cache_key": spec.cache_key(),
        "heldout_greedy_accuracy": accuracy,
        "build_seconds": round(time.perf_counter() - started, 2),
    }
    (folder / SPEC_FILE).write_text(json.dumps(record, indent=2))
    return folder


def ensure_tiny_model(cache_dir: str | os.PathLike, spec: TinyModelSpec | None = None, log=print) -> Path:
    """The tiny model folder for `spec` under cache_dir/<key>, built on first use and reused after."""
    spec = spec or TinyModelSpec()
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    folder = cache_dir / spec.cache_key()
    with open(cache_dir / f"{spec.cache_key()}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same key
        if (folder / SPEC_FILE).is_file():
            return folder
        tmp = cache_dir / f"{spec.cache_key()}.tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        build_tiny_model(tmp, spec, log=log)
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
    return folder


def tiny_model_info(folder: str | os.PathLike) -> dict:
    """The build record (spec, warm-start accuracy) of a tiny model folder."""
    return json.loads((Path(folder) / SPEC_FILE).read_text())
