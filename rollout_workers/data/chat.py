"""How prompts are written for one model: text as is, chat messages through a chat template.

`rollout.task.chat_template`:
  auto   messages go through the tokenizer's own template (`apply_chat_template(...,
         add_generation_prompt=True)`), text prompts are tokenized as they are
  none   no template: a message prompt is its contents joined by newlines (for base models)
  PATH   a Jinja file used instead of the tokenizer's template for message prompts
As verl does, the template renders text and the text is tokenized without adding special tokens
(a template writes its own BOS). `rollout.task.chat_template_kwargs` go to the template (e.g.
`{enable_thinking: false}` for Qwen3).

The model folder also says when a response ends: the tokenizer's EOS and every `eos_token_id`
of `generation_config.json` (instruct models often list two: end of turn and end of text), and
how long a sequence may be: `rollout.engine.max_model_len`, else the model config's context (and
for a multi-turn run, `rollout.multi_turn.max_total_tokens` where it is shorter).
A prompt too long to leave a response its `max_new_tokens` is refused, or cut to fit where
`rollout.task.truncation` says so (verl's data.truncation: left, right, middle).
"""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path

from rollout_workers.data.problems import Problem

TEMPLATE_MODES = ("auto", "none")
# The exchange `encode_followup` renders messages after; a reasoning_content keeps a thinking template
# (Qwen3) writing the assistant turn alike whether or not messages follow it, as verl's does.
_EARLIER = [{"role": "user", "content": "?"}, {"role": "assistant", "content": ".", "reasoning_content": "."}]
# config.json keys that bound a model's context (vLLM's list); the smallest present wins.
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length",
                 "max_seq_length", "seq_len")


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _config_parts(model_dir: str | os.PathLike) -> tuple[dict, dict]:
    """The model folder's config.json and its `text_config` ({} if none): a multimodal model's config
    holds its language model's there."""
    config = _read_json(Path(model_dir) / "config.json")
    return config, config.get("text_config") if isinstance(config.get("text_config"), dict) else {}


def model_context_len(model_dir: str | os.PathLike) -> int | None:
    """The longest sequence (prompt + response) the model folder's config allows; None: it says not."""
    limits = [int(part[k]) for part in _config_parts(model_dir) for k in _CONTEXT_KEYS
              if isinstance(part.get(k), int) and part[k] > 0]
    return min(limits) if limits else None


def context_can_stretch(model_dir: str | os.PathLike) -> bool:
    """Whether the model's config scales its positions (RoPE scaling: YaRN, dynamic ...), so an
    engine may serve more than `model_context_len`."""
    for part in _config_parts(model_dir):
        scaling = part.get("rope_scaling") or part.get("rope_parameters")
        if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type", "default")) != "default":
            return True
    return False


def eos_token_ids(model_dir: str | os.PathLike, tokenizer) -> tuple[int, ...]:
    """The ids that end a response: the tokenizer's EOS, then generation_config.json's eos_token_id(s)."""
    found = [tokenizer.eos_token_id]
    generation = _read_json(Path(model_dir) / "generation_config.json").get("eos_token_id")
    found += generation if isinstance(generation, list) else [generation]
    out: list[int] = []
    for token in found:
        if isinstance(token, int) and token not in out:
            out.append(token)
    return tuple(out)


def read_template(chat_template: str) -> str | None:
    """The Jinja text of a `chat_template` PATH; None for auto and none."""
    if chat_template in TEMPLATE_MODES:
        return None
    path = Path(chat_template)
    if not path.is_file():
        raise FileNotFoundError(f"rollout.task.chat_template: {chat_template!r} is neither auto, none nor a "
                                f"Jinja file that exists")
    return path.read_text(encoding="utf-8")


class PromptFormat:
    """Turns a problem's prompt into the token ids a model expects, and knows the model's context
    length and the ids that end a response."""

    def __init__(self, tokenizer, chat_template: str = "auto", template_kwargs: dict | None = None,
                 context_len: int | None = None, stop_token_ids: tuple[int, ...] = (),
                 model_name: str = "the model", truncation: str = "error"):
        self.tokenizer = tokenizer
        self.mode = chat_template if chat_template in TEMPLATE_MODES else "file"
        self.template = read_template(chat_template)
        self.template_kwargs = dict(template_kwargs or {})
        self.context_len = context_len
        self.stop_token_ids = tuple(stop_token_ids)
        self.model_name = model_name
        self.truncation = truncation
        self.selectable_tools = False  # the tools environment's: a prompt may select some (for_rollout)

    @classmethod
    def for_model(cls, model_dir: str | os.PathLike, task, tokenizer,
                  max_model_len: int | None = None) -> "PromptFormat":
        """The format of a model folder under a TaskConfig (`max_model_len`: the engine's, if set)."""
        return cls(tokenizer, task.chat_template, task.chat_template_kwargs,
                   context_len=max_model_len or model_context_len(model_dir),
                   stop_token_ids=eos_token_ids(model_dir, tokenizer), model_name=str(model_dir),
                   truncation=task.truncation)

    @classmethod
    def for_rollout(cls, model_dir: str | os.PathLike, rollout, tokenizer) -> "PromptFormat":
        """The format of a RolloutConfig's run: its context is the engine's, or a multi-turn
        trajectory's `max_total_tokens` where that is shorter (no sample is longer); a run of the
        built-in tools environment gives the template its tools' schemas (`tools`), unless
        `rollout.task.chat_template_kwargs` names them; with those, a prompt whose extra_info has a
        `tool_selection` is rendered with the tools it selects only (verl's per-sample tools)."""
        context = rollout.engine.max_model_len or model_context_len(model_dir)
        total = rollout.multi_turn.max_total_tokens if rollout.multi_turn.enabled else None
        if total and (context is None or total < context):
            context = total
        fmt = cls.for_model(model_dir, rollout.task, tokenizer, context)
        if rollout.multi_turn.environment == "tools" and "tools" not in fmt.template_kwargs:
            # imported here: only a tools run loads its tools (and transformers' schema reader)
            from rollout_workers.environments.function_tools import tool_schemas

            kwargs = rollout.multi_turn.environment_kwargs
            fmt.template_kwargs["tools"] = tool_schemas(kwargs.get("path"), kwargs.get("config"))
            fmt.selectable_tools = True
        return fmt

    def describe(self) -> str:
        template = {"auto": "the tokenizer's own", "none": "none", "file": "the Jinja file given"}[self.mode]
        context = self.context_len if self.context_len else "not stated by the model"
        return f"chat template: {template}; context: {context} tokens; response ends at ids {list(self.stop_token_ids)}"

    def render(self, problem: Problem, generation_prompt: bool = True) -> str:
        """The exact text the tokenizer gets. ValueError says why a chat prompt cannot be rendered."""
        if not problem.is_chat:
            return problem.prompt
        if self.mode == "none":
            return "\n".join(m["content"] for m in problem.prompt)
        if self.mode == "auto" and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"the prompt is chat messages but the tokenizer of {self.model_name} has no chat "
                             f"template (set rollout.task.chat_template to a Jinja file, or to none)")
        template_kwargs = self._template_kwargs(problem)
        try:
            return self.tokenizer.apply_chat_template(problem.prompt, chat_template=self.template, tokenize=False,
                                                      add_generation_prompt=generation_prompt, **template_kwargs)
        except Exception as err:  # a template may raise on purpose (e.g. "system role not supported")
            raise ValueError(f"the chat template failed on this prompt: {type(err).__name__}: {err}") from None

    def _template_kwargs(self, problem: Problem) -> dict:
        if not self.selectable_tools:
            return self.template_kwargs
        from rollout_workers.environments.function_tools import prompt_tools

        tools = {schema["function"]["name"]: schema for schema in self.template_kwargs["tools"]}
        return {**self.template_kwargs, "tools": list(prompt_tools(tools, problem.extra_info)[0].values())}

    def encode_followup(self, messages: list[dict]) -> list[int]:
        """The token ids of chat messages that follow a policy turn (a tool's result, a user's reply),
        the generation prompt of the next turn included: what the chat template writes for them
        after an earlier exchange, without what it writes before (a default system prompt, the
        tools). What the template writes after the end-of-turn token that ended the policy's turn
        (Qwen's newline after <|im_end|>) comes first: the policy stopped at that token. ValueError
        says why they cannot be rendered."""
        if self.mode == "none":
            return self._tokens("\n".join(m["content"] for m in messages))
        before, after_turn = self._exchange
        after = self.render(Problem(_EARLIER + list(messages), ""))
        if not after.startswith(before):
            raise ValueError("the chat template writes an exchange differently when messages follow it, so the "
                             "messages cannot be appended as tokens (return text from the environment instead)")
        return self._tokens(after_turn + after[len(before):])

    @functools.cached_property
    def _exchange(self) -> tuple[str, str]:
        """The template's text of the dummy exchange `encode_followup` renders after, and what it writes
        after that exchange's last end-of-turn token (a stop token's text): the same for every
        observation, so rendered once."""
        before = self.render(Problem(_EARLIER, ""), generation_prompt=False)
        ends = [before.rfind(stop) + len(stop)
                for stop in self.tokenizer.convert_ids_to_tokens(list(self.stop_token_ids)) if stop and stop in before]
        return before, before[max(ends, default=len(before)):]

    def _tokens(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode(self, problem: Problem, max_new_tokens: int | None = None) -> list[int]:
        """The prompt's token ids, cut to leave `max_new_tokens` within the context where the
        truncation is not "error" (None: never cut)."""
        ids = self._tokens(self.render(problem))
        return ids if max_new_tokens is None else self.cut(ids, max_new_tokens)

    def prompt_room(self, max_new_tokens: int | None) -> int | None:
        """The most prompt tokens that leave `max_new_tokens` within the context; None: no bound known."""
        return self.context_len - (max_new_tokens or 0) if self.context_len else None

    def cuts(self, length: int, max_new_tokens: int | None) -> bool:
        """Whether a prompt of `length` tokens is cut to fit (over the room, truncation on, room left)."""
        room = self.prompt_room(max_new_tokens)
        return self.truncation != "error" and room is not None and 0 < room < length

    def cut(self, ids: list[int], max_new_tokens: int | None) -> list[int]:
        """`ids` cut to the room as verl's truncation does: left keeps the last tokens, right the first,
        middle the first half and the last (a prompt that fits, or truncation "error": as it is)."""
        if not self.cuts(len(ids), max_new_tokens):
            return ids
        room = self.prompt_room(max_new_tokens)
        if self.truncation == "left":
            return ids[-room:]
        if self.truncation == "right":
            return ids[:room]
        first = room // 2
        return ids[:first] + ids[len(ids) - (room - first):]
