"""Prompt files (etarl's flat form and verl's RL dataset layout, JSONL and parquet), chat templates,
and the prompt checks shared by a run's start, its workers and `etarl data check`: every unusable
row named with its file, row number and reason, refused by default or skipped on request."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollout_workers.config import TaskConfig
from rollout_workers.data import (
    MAX_LISTED,
    InvalidPrompts,
    Problem,
    PromptFormat,
    check_prompts,
    eos_token_ids,
    heldout_problems,
    model_context_len,
    read_prompt_file,
    train_prompts,
)
from rollout_workers.tiny_model import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    """The tiny kit's tokenizer: one token per character, and a chat template."""
    return build_tokenizer()


def verl_row(index: int, question: str, answer, **changes) -> dict:
    """A row as verl's data preprocessing scripts write them (examples/data_preprocess/gsm8k.py)."""
    row = {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": question}], "ability": "math",
           "reward_model": {"style": "rule", "ground_truth": answer},
           "extra_info": {"split": "train", "index": index, "question": question}}
    row.update(changes)
    return row


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_verl_parquet_is_read_as_it_is(tmp_path):
    path = write_parquet(tmp_path / "train.parquet", [verl_row(0, "12+3=", "15"), verl_row(1, "rev:abc=", "cba")])
    problems = read_prompt_file(path, TaskConfig(kind="file", path=str(path))).problems
    first = problems[0]
    assert first.prompt == [{"role": "user", "content": "12+3="}] and first.is_chat
    assert first.answer == "15" and first.data_source == "openai/gsm8k"
    assert first.extra_info == {"split": "train", "index": 0, "question": "12+3="}
    assert (first.source, first.row, problems[1].row) == (str(path), 1, 2)


def test_flat_rows_configurable_keys_and_dotted_paths(tmp_path):
    flat = write_jsonl(tmp_path / "flat.jsonl", [{"question": "What is 2+2?", "solution": "4"}, "",
                                                  {"question": "3*3?", "solution": 9}])
    task = TaskConfig(kind="file", path=str(flat), prompt_key="question", answer_key="solution")
    problems = read_prompt_file(flat, task).problems
    assert [(p.prompt, p.answer, p.row) for p in problems] == [("What is 2+2?", "4", 1), ("3*3?", 9, 3)]
    assert problems[1].answer_text == "9"  # what an etarl-form reward gets
    nested = write_jsonl(tmp_path / "nested.jsonl", [{"q": {"text": "1+1="}, "meta": {"gold": {"value": "2"}}}])
    task = TaskConfig(kind="file", path=str(nested), prompt_key="q.text", answer_key="meta.gold.value")
    assert [(p.prompt, p.answer) for p in read_prompt_file(nested, task).problems] == [("1+1=", "2")]
    # With answer_key unset, verl rows use reward_model.ground_truth and flat rows use answer.
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [verl_row(0, "q", "a"), {"prompt": "p", "answer": "b"}])
    assert [p.answer for p in read_prompt_file(mixed, TaskConfig(kind="file", path=str(mixed))).problems] == ["a", "b"]
    array = tmp_path / "array.json"
    array.write_text(json.dumps([{"prompt": "x", "answer": "1"}]))
    assert read_prompt_file(array, TaskConfig(kind="file", path=str(array))).problems[0].answer == "1"


def test_every_unusable_row_is_named_with_its_row_number_and_reason(tmp_path):
    rows = [
        {"prompt": "ok=", "answer": "1"},                            # 1
        {"prompt": "no answer"},                                     # 2
        "{oops",                                                     # 3
        {"prompt": "   ", "answer": "1"},                            # 4
        {"prompt": [], "answer": "1"},                               # 5
        {"prompt": [{"role": "user"}], "answer": "1"},               # 6
        {"prompt": [{"role": "user", "content": ""}], "answer": "1"},  # 7
        [1, 2],                                                      # 8
        {"answer": "1"},                                             # 9
        verl_row(9, "q", None),                                      # 10
        {"prompt": 5, "answer": "1"},                                # 11
        {"prompt": "fine=", "answer": ""},                           # 12
        {"prompt": "also ok=", "answer": 0},                         # 13
    ]
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    report = check_prompts(path, TaskConfig(kind="file", path=str(path)))
    assert [p.row for p in report.problems] == [1, 13]
    why = {bad.row: bad.why for bad in report.bad}
    assert sorted(why) == [2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    assert why[2].startswith("no answer ('answer'") and why[10].startswith("no answer ('reward_model.ground_truth'")
    assert why[3].startswith("not valid JSON") and why[4] == "empty prompt" and why[5] == "empty prompt (no messages)"
    assert why[6] == "message 1 has no text content" and why[7] == "empty prompt (every message is blank)"
    assert why[8] == "not a map of columns, got list" and why[9] == "no prompt ('prompt')"
    assert why[11] == "prompt must be text or a list of chat messages, got int" and why[12].startswith("no answer")
    assert str(report.bad[0]) == f"{path} row 2: {why[2]}"

    with pytest.raises(InvalidPrompts) as refused:
        report.usable(skip_invalid=False)
    message = str(refused.value)
    assert f"{path}: 13 rows, 2 usable, 11 unusable" in message and f"{path} row 12: no answer" in message
    assert "rollout.task.skip_invalid=true" in message
    assert [p.row for p in report.usable(skip_invalid=True)] == [1, 13]


def test_the_listing_stops_at_twenty_rows_and_gives_the_count(tmp_path):
    path = write_jsonl(tmp_path / "many.jsonl", [{"prompt": f"p{i}"} for i in range(25)] + [{"prompt": "x", "answer": 1}])
    summary = check_prompts(path, TaskConfig(kind="file", path=str(path))).summary()
    assert "unusable rows (25; the first 20)" in summary
    assert sum(line.startswith(f"    {path} row ") for line in summary.splitlines()) == MAX_LISTED == 20
    assert f"row 20:" in summary and f"row 21:" not in summary
    empty = write_jsonl(tmp_path / "empty.jsonl", [])
    with pytest.raises(InvalidPrompts, match="holds no usable prompt"):
        check_prompts(empty, TaskConfig(kind="file", path=str(empty))).usable(skip_invalid=True)


def test_prompts_are_checked_in_tokens_against_the_engine_context(tmp_path, tokenizer):
    prompts = ["1+1=", "12+34=", "rev:abcdefghij=", "rev:" + "a" * 40 + "="]
    path = write_parquet(tmp_path / "p.parquet", [{"prompt": p, "answer": "x"} for p in prompts])
    task = TaskConfig(kind="file", path=str(path))
    fmt = PromptFormat(tokenizer, context_len=32)
    report = check_prompts(path, task, fmt, max_new_tokens=16)
    # 4, 6 and 15 tokens fit in 32 - 16; the 45-token prompt does not.
    assert report.token_counts == [4, 6, 15] and [p.row for p in report.problems] == [1, 2, 3]
    assert [(b.row, b.why) for b in report.bad] == [
        (4, "prompt of 45 tokens + max_new_tokens 16 exceeds the engine's context of 32 tokens")]
    assert report.token_stats() == {"p50": 6, "p99": 15, "max": 15}
    assert "tokens per prompt: p50 6, p99 15, max 15 (context 32 - max_new_tokens 16: prompts of up to 16" \
           in report.summary()
    # The same file under a longer context is fully usable.
    assert not check_prompts(path, task, PromptFormat(tokenizer, context_len=64), max_new_tokens=16).bad


@pytest.mark.parametrize("truncation", ["left", "right", "middle"])
def test_a_prompt_too_long_is_cut_to_fit_where_truncation_says(tmp_path, tokenizer, truncation):
    prompts = ["1+1=", "rev:" + "abcdefghij" * 4 + "="]
    path = write_parquet(tmp_path / "p.parquet", [{"prompt": p, "answer": "x"} for p in prompts])
    task = TaskConfig(kind="file", path=str(path), truncation=truncation)
    fmt = PromptFormat.for_model(tmp_path, task, tokenizer, max_model_len=32)
    assert fmt.truncation == truncation
    report = check_prompts(path, task, fmt, max_new_tokens=16)
    # the 45-token prompt is usable now, counted as cut; its length is the one it had
    assert not report.bad and [p.row for p in report.problems] == [1, 2]
    assert report.cut == 1 and report.token_counts == [4, 45]
    assert f"1 prompts cut to fit (rollout.task.truncation={truncation})" in report.summary()
    whole = fmt.encode(report.problems[1])
    assert len(whole) == 45  # without max_new_tokens: never cut
    cut = fmt.encode(report.problems[1], max_new_tokens=16)
    want = {"left": whole[-16:], "right": whole[:16], "middle": whole[:8] + whole[-8:]}[truncation]
    assert cut == want and len(cut) + 16 == 32
    assert fmt.encode(report.problems[0], max_new_tokens=16) == fmt.encode(report.problems[0])  # it fits: as it is
    assert fmt.encode(report.problems[1], max_new_tokens=10) == \
        {"left": whole[-22:], "right": whole[:22], "middle": whole[:11] + whole[-11:]}[truncation]
    # no room at all (max_new_tokens fills the context): still refused, whatever the truncation
    report = check_prompts(path, task, fmt, max_new_tokens=32)
    assert [b.row for b in report.bad] == [1, 2] and report.cut == 0
    assert fmt.encode(Problem("rev:" + "a" * 40 + "=", "x"), max_new_tokens=32) == \
        fmt.encode(Problem("rev:" + "a" * 40 + "=", "x"))
    with pytest.raises(ValueError, match="truncation"):
        TaskConfig(kind="file", path=str(path), truncation="both")


QWEN_LIKE = (  # written for this test in the shape of Qwen2.5's: a default system prompt, tools, tool turns
    "{%- if messages[0]['role'] != 'system' %}{{ '<s>sys:' + ('tools ' + tools|length|string if tools else 'plain')"
    " + '</s>' }}{%- endif %}"
    "{%- for m in messages %}{%- if m['role'] == 'tool' %}{{ '<s>user:<tool_response>' + m['content'] + "
    "'</tool_response></s>' }}{%- else %}{{ '<s>' + m['role'] + ':' + m['content'] + '</s>' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<s>assistant:' }}{%- endif %}")


def test_messages_that_follow_a_turn_are_what_the_template_writes_after_it(tmp_path, tokenizer):
    template = tmp_path / "qwen_like.jinja"
    template.write_text(QWEN_LIKE)
    tool = [{"role": "tool", "content": "42"}]
    fmt = PromptFormat(tokenizer, chat_template=str(template), template_kwargs={"tools": [{"name": "calc"}]})
    want = "<s>user:<tool_response>42</tool_response></s><s>assistant:"  # no system prompt, no tools again
    assert fmt.encode_followup(tool) == tokenizer(want, add_special_tokens=False)["input_ids"]
    assert fmt.render(Problem([{"role": "user", "content": "hi"}], "")).startswith("<s>sys:tools 1</s>")
    two = tool + [{"role": "user", "content": "go on"}]
    assert fmt.encode_followup(two) == tokenizer(want[:-len("<s>assistant:")] + "<s>user:go on</s><s>assistant:",
                                                 add_special_tokens=False)["input_ids"]
    none = PromptFormat(tokenizer, chat_template="none")
    assert none.encode_followup(two) == tokenizer("42\ngo on", add_special_tokens=False)["input_ids"]
    # a template that writes the earlier exchange differently once messages follow it: refused, said why
    shifty = tmp_path / "shifty.jinja"
    shifty.write_text("{{ messages|length|string }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(ValueError, match="writes an exchange differently"):
        PromptFormat(tokenizer, chat_template=str(shifty)).encode_followup(tool)


def test_chat_prompts_go_through_the_chat_template(tmp_path, tokenizer):
    messages = [{"role": "system", "content": "rev"}, {"role": "user", "content": "rev:abc="}]
    chat = Problem(messages, "cba")
    auto = PromptFormat(tokenizer)
    expected = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert auto.encode(chat) == list(expected)
    assert auto.render(chat) == "<|user|>rev<eos><|user|>rev:abc=<eos><|assistant|>"
    assert auto.encode(Problem("rev:abc=", "cba")) == tokenizer("rev:abc=", add_special_tokens=False)["input_ids"]
    assert PromptFormat(tokenizer, chat_template="none").render(chat) == "rev\nrev:abc="

    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}={% endfor %}{% if add_generation_prompt %}"
                        "{{ extra }}{% endif %}")
    from_file = PromptFormat(tokenizer, chat_template=str(template), template_kwargs={"extra": "a"})
    assert from_file.render(chat) == "rev=rev:abc==a"
    with pytest.raises(FileNotFoundError, match="neither auto, none nor a Jinja file"):
        PromptFormat(tokenizer, chat_template=str(tmp_path / "missing.jinja"))

    # A tokenizer without a template, and a template that refuses a prompt: unusable rows, named.
    bare = build_tokenizer()
    bare.chat_template = None
    path = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": messages, "answer": "cba"}])
    task = TaskConfig(kind="file", path=str(path))
    report = check_prompts(path, task, PromptFormat(bare, model_name="my-model"), max_new_tokens=4)
    assert "tokenizer of my-model has no chat template" in report.bad[0].why
    strict = tmp_path / "strict.jinja"
    strict.write_text("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
                      "{% endif %}{{ messages[-1]['content'] }}")
    report = check_prompts(path, task, PromptFormat(tokenizer, chat_template=str(strict)), max_new_tokens=4)
    assert report.bad[0].row == 1 and "System role not supported" in report.bad[0].why


def test_the_model_folder_says_when_a_response_ends_and_how_long_it_may_be(tmp_path, tokenizer):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096, "seq_length": 2048}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [31, 1], "temperature": 0.7}))
    assert model_context_len(tmp_path) == 2048
    assert eos_token_ids(tmp_path, tokenizer) == (1, 31)  # the tokenizer's EOS first, each id once
    fmt = PromptFormat.for_model(tmp_path, TaskConfig(), tokenizer)
    assert fmt.context_len == 2048 and fmt.stop_token_ids == (1, 31)
    assert PromptFormat.for_model(tmp_path, TaskConfig(), tokenizer, max_model_len=512).context_len == 512
    # a multimodal model's language model says its context under text_config
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 8192}}))
    assert model_context_len(tmp_path) == 8192
    (tmp_path / "generation_config.json").unlink()
    (tmp_path / "config.json").write_text("{}")
    assert model_context_len(tmp_path) is None and eos_token_ids(tmp_path, tokenizer) == (1,)


def test_skipping_is_the_same_for_every_reader_so_tickets_map_alike(tmp_path, tokenizer):
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} if i % 3 else {"prompt": f"{i}+1="} for i in range(9)]
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    held = write_jsonl(tmp_path / "held.jsonl", rows[:4])
    task = TaskConfig(kind="file", path=str(path), heldout_path=str(held), skip_invalid=True)
    fmt = PromptFormat(tokenizer, context_len=64)
    first, second = train_prompts(task, fmt, 8), train_prompts(task, fmt, 8)
    assert [p.row for p in first.problems] == [2, 3, 5, 6, 8, 9] == [p.row for p in second.problems]
    assert first.problem(7).prompt == "2+1="  # ticket 7 wraps to the second usable row
    assert [p.row for p in heldout_problems(task, 5, prompt_format=fmt, max_new_tokens=8)] == [2, 3]
    with pytest.raises(InvalidPrompts, match="row 1: no answer"):
        train_prompts(task.model_copy(update={"skip_invalid": False}), fmt, 8)


def test_several_train_files_follow_each_other_and_heldout_files_take_turns(tmp_path):
    first = write_jsonl(tmp_path / "a.jsonl", [{"prompt": f"a{i}", "answer": "x"} for i in range(3)])
    second = write_parquet(tmp_path / "b.parquet", [verl_row(i, f"b{i}", "y") for i in range(2)])
    task = TaskConfig(kind="file", path=[str(first), str(second)], heldout_path=[str(first), str(second)])
    assert task.files("path") == {"rollout.task.path[0]": str(first), "rollout.task.path[1]": str(second)}
    assert TaskConfig(kind="file", path="x.jsonl").files("path") == {"rollout.task.path": "x.jsonl"}
    prompts = train_prompts(task)
    assert [(p.source, p.row) for p in prompts.problems] == [(str(first), 1), (str(first), 2), (str(first), 3),
                                                             (str(second), 1), (str(second), 2)]
    # a cap on the held-out prompts takes some of every file
    assert [p.text for p in heldout_problems(task, 3)] == ["a0", "b0", "a1"]
    assert [p.text for p in heldout_problems(task, 10)] == ["a0", "b0", "a1", "b1", "a2"]
    with pytest.raises(ValueError, match="at least one file"):
        TaskConfig(kind="file", path=[])


def test_shuffled_prompts_use_each_row_once_per_pass_in_an_order_every_reader_shares(tmp_path):
    rows = [{"prompt": f"{i}+0=", "answer": str(i)} for i in range(50)]
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    task = TaskConfig(kind="file", path=str(path), shuffle=True, seed=3)
    worker, other = train_prompts(task), train_prompts(task)
    passes = [[worker.problem(t).row for t in range(p * 50, (p + 1) * 50)] for p in range(3)]
    assert all(sorted(order) == list(range(1, 51)) for order in passes)  # every row once a pass
    assert passes[0] != passes[1] != passes[2] and passes[0] != list(range(1, 51))  # a new order each pass
    # another worker (or the run after a resume), asked tickets out of order, sees the same rows
    for ticket in (149, 3, 77, 50, 120, 0):
        assert other.problem(ticket).row == passes[ticket // 50][ticket % 50]
    assert [train_prompts(task.model_copy(update={"seed": 4})).problem(t).row for t in range(50)] != passes[0]
    # a prompt's position in the set is its identity on every pass (what a worker quarantines)
    for ticket in (0, 49, 50, 77, 149):
        assert worker.problems[worker.position(ticket)] == worker.problem(ticket)
        assert worker.position(ticket) == passes[ticket // 50][ticket % 50] - 1
    negative = train_prompts(task.model_copy(update={"seed": -4}))  # run.seed may be negative
    assert sorted(negative.problem(t).row for t in range(50)) == list(range(1, 51))
    assert [train_prompts(task.model_copy(update={"shuffle": False})).problem(t).row for t in range(50)] == \
        list(range(1, 51))
    synthetic = TaskConfig(num_prompts=20, shuffle=True)
    assert sorted(p.prompt for p in (train_prompts(synthetic).problem(t) for t in range(20))) == \
        sorted(p.prompt for p in train_prompts(synthetic.model_copy(update={"shuffle": False})).problems)
