"""The built-in `tools` environment (rollout_workers/environments/function_tools.py): Python functions
as tools, called in Qwen's and verl's hermes format, their results as tool messages through the
chat template, the final answer scored by the run's reward. verl's own function-tools file loads
as it is, and so do verl's BaseTool classes and their tool config YAML. The agent loop runs with a
byte-level tokenizer trained here (every text has tokens) and a scripted policy in place of an
engine (the tiny model never learned to call tools)."""
from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path

import pytest
import yaml

from rollout_workers.agent_loop import AgentLoop
from rollout_workers.config import MultiTurnConfig, RolloutConfig
from rollout_workers.data import Problem, PromptFormat
from rollout_workers.engines.base import Completion, SamplingParams
from rollout_workers.environments.function_tools import FunctionTools, load_tools, tool_schemas

VERL_TOOLS = '''
import asyncio

from verl.tools.function_tool import function_tool


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


@function_tool("weather")
async def get_weather(city: str) -> dict:
    """The weather in a city.

    Args:
        city: Its name.
    """
    await asyncio.sleep(0)
    return {"city": city, "temperature_c": 17.3}


@function_tool
def fails(x: int) -> str:
    """Always raises.

    Args:
        x: Anything.
    """
    raise RuntimeError("the sandbox is down")


@function_tool
def lookup(key: str):
    """A lookup that rewards its call (verl's (response, reward) return).

    Args:
        key: What to look up.
    """
    return f"found {key}", 0.5


@function_tool
def nothing(key: str):
    """Returns None (verl writes it as str() does).

    Args:
        key: Anything.
    """
    return None


def helper():  # not decorated: not a tool where others are
    return 0
'''
TEMPLATES = Path(__file__).parent / "templates"  # Qwen's chat templates' shapes, written for these tests
TEMPLATE = (  # Qwen2.5's shape, simplified: tools in the system turn, tool results in a user turn
    "{%- if tools %}{{ '<|im_start|>system\\n# Tools\\n' }}{%- for t in tools %}{{ t['function']['name'] + '\\n' }}"
    "{%- endfor %}{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{%- if m['role'] == 'tool' %}{{ '<|im_start|>user\\n<tool_response>\\n' + m['content'] "
    "+ '\\n</tool_response><|im_end|>\\n' }}{%- else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- endif %}")


@pytest.fixture(autouse=True)
def fresh_event_loop():
    """Each test's tools get their own process loop (as each environment process has one), closed after."""
    import rollout_workers.environments.function_tools as function_tools

    yield
    if function_tools._LOOP is not None:
        function_tools._LOOP.close()
        function_tools._LOOP = None
        asyncio.set_event_loop(None)


@pytest.fixture
def verl_tools(tmp_path) -> str:
    path = tmp_path / "my_tools.py"
    path.write_text(VERL_TOOLS)
    return str(path)


@pytest.fixture(scope="module")
def byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator([TEMPLATE, VERL_TOOLS, '<tool_call>{"name": "add"}</tool_call> 5'],
                            trainers.BpeTrainer(vocab_size=400, special_tokens=["<|im_end|>", "<pad>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>", pad_token="<pad>")
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def test_a_verl_function_tools_file_loads_as_it_is(verl_tools):
    tools = load_tools(verl_tools)
    assert sorted(tools) == ["add", "fails", "lookup", "nothing", "weather"]  # the decorated ones, by their names
    assert "verl.tools.function_tool" not in sys.modules  # the stand-in is gone once loaded
    schemas = {s["function"]["name"]: s for s in tool_schemas(verl_tools)}
    assert schemas["add"] == {"type": "function", "function": {  # as verl's schema model keeps it: no return
        "name": "add", "description": "Add two integers.", "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "description": "The first."}, "b": {"type": "integer", "description": "The second."}},
            "required": ["a", "b"]}}}
    assert schemas["weather"]["function"]["parameters"]["properties"]["city"]["type"] == "string"


def test_a_plain_file_offers_every_public_function_and_a_bad_one_is_named(tmp_path):
    plain = tmp_path / "plain_tools.py"
    plain.write_text('def double(x: int) -> int:\n    """Twice x.\n\n    Args:\n        x: A number.\n    """\n'
                     '    return 2 * x\n\n\ndef _private():\n    return 1\n')
    assert list(load_tools(str(plain))) == ["double"]
    bad = tmp_path / "bad_tools.py"
    bad.write_text("def undocumented(x):\n    return x\n")
    with pytest.raises(ValueError, match="undocumented.*type hints and a docstring"):
        tool_schemas(str(bad))
    empty = tmp_path / "empty_tools.py"
    empty.write_text("X = 1\n")
    with pytest.raises(ValueError, match="defines no public function"):
        load_tools(str(empty))


def test_calls_come_back_as_tool_messages_and_the_last_turn_is_scored(verl_tools):
    env = FunctionTools(verl_tools, reward="exact", max_tool_turns=3, max_parallel_calls=2)
    env.reset(Problem("2+3?", "5"))
    two = env.step('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>\n'
                   '<tool_call>{"name": "weather", "arguments": {"city": "Tokyo"}}</tool_call>')
    assert two.observation == [{"role": "tool", "content": "5"},
                               {"role": "tool", "content": '{"city": "Tokyo", "temperature_c": 17.3}'}]
    assert not two.done and two.reward == 0.0
    # not JSON, or without arguments: no call (as verl's parser); two of the rest run (max_parallel_calls)
    wrong = env.step('<tool_call>{oops</tool_call><tool_call>{"name": "add"}</tool_call>'
                     '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
                     '<tool_call>{"name": "fails", "arguments": {"x": 1}}</tool_call>'
                     '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>')
    assert [m["content"] for m in wrong.observation] == [  # verl's words
        "Unknown function 'nope'. Available tools: ['add', 'weather', 'fails', 'lookup', 'nothing']",
        "Error executing tool 'fails': the sandbox is down"]
    found = env.step('<tool_call>{"name": "lookup", "arguments": {"key": "k"}}</tool_call>')
    assert found.observation == [{"role": "tool", "content": "found k"}] and found.reward == 0.0
    last = env.step('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call> 5')
    assert last.done and last.reward == 1.0  # past max_tool_turns (3): the answer, call blocks removed
    assert last.info == {"correct": 1.0, "tool_calls": 5.0, "tool_errors": 2.0, "tool_reward": 0.5}
    env.reset(Problem("?", "x"))
    said = env.step('<tool_call>{"name": "nothing", "arguments": {"key": "k"}}</tool_call>'
                    '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert said.observation[0]["content"] == "None"
    assert said.observation[1]["content"].startswith("Error executing tool 'add': ")  # arguments not an object
    for side in ("middle", "left", "right"):
        env = FunctionTools(verl_tools, reward="exact", max_tool_response_length=20, tool_response_truncate_side=side)
        env.reset(Problem("?", "5"))
        city = "a" * 40 + "z" * 40
        said = env.step('<tool_call>{"name": "weather", "arguments": {"city": "' + city + '"}}</tool_call>')
        text = json.dumps({"city": city, "temperature_c": 17.3})
        want = {"middle": text[:10] + "...(truncated)..." + text[-10:], "left": "(truncated)..." + text[-20:],
                "right": text[:20] + "...(truncated)"}[side]
        assert said.observation[0]["content"] == want


def test_the_answer_is_scored_with_the_tools_rewards_in_extra_info(verl_tools, tmp_path):
    reward = tmp_path / "sees_tool_rewards.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return sum(extra_info['tool_rewards']) + float(solution_str == ground_truth)\n")
    env = FunctionTools(verl_tools, reward=f"{reward}:compute_score")
    env.reset(Problem("?", "5", extra_info={"index": 1}))
    env.step('<tool_call>{"name": "lookup", "arguments": {"key": "k"}}</tool_call>')
    assert env.step("5").reward == 1.5


def test_a_thinking_and_a_plain_qwen_template_append_what_they_would_write_whole(byte_tokenizer):
    """The trajectory (prompt, the policy's turn as generated up to <|im_end|>, the tool message's
    tokens) is the text the template writes for the whole conversation, for Qwen2.5's shape
    (its newline after <|im_end|>) and Qwen3's (thinking kept for a turn after the last query)."""
    turn = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    for template, generated, assistant in [
            ("qwen2.5_like.jinja", turn, {"content": turn}),
            ("qwen3_like.jinja", "<think>\nadd them\n</think>\n\n" + turn,
             {"content": turn, "reasoning_content": "add them"})]:
        fmt = PromptFormat(byte_tokenizer, chat_template=str(TEMPLATES / template),
                           stop_token_ids=(byte_tokenizer.eos_token_id,))
        user = [{"role": "user", "content": "2+3?"}]
        tool = [{"role": "tool", "content": "5"}]
        prompt = fmt.render(Problem(user, ""))
        followup = byte_tokenizer.decode(fmt.encode_followup(tool))
        whole = fmt.render(Problem(user + [{"role": "assistant", **assistant}] + tool, ""))
        assert prompt + generated + "<|im_end|>" + followup == whole, template
        assert followup.startswith("\n<|im_start|>user\n<tool_response>\n5")


def scripted_episode(rollout: RolloutConfig, fmt: PromptFormat, problem: Problem, script: list[str]):
    """One trajectory of the agent loop (its environments in their processes) where the policy is a
    script: script[0] as the first turn, script[1] once a tool's response is in the context, each
    ending at EOS."""
    tokenizer = fmt.tokenizer

    def generate(requests):
        out = []
        for context, _ in requests:
            turn = script[1] if "<tool_response>" in tokenizer.decode(context) else script[0]
            ids = tokenizer(turn, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            out.append([(Completion(ids, [-0.5] * len(ids), "stop"), [0] * len(ids))])
        return out

    loop = AgentLoop.for_rollout(rollout, tokenizer, fmt)
    try:
        (episode,), = loop.run([(problem, SamplingParams(n=1, max_new_tokens=64,
                                                         stop_token_ids=(tokenizer.eos_token_id,)))], generate)
    finally:
        loop.close()
    return episode


def test_the_agent_loop_runs_tools_through_the_chat_template(verl_tools, byte_tokenizer, tmp_path):
    rollout = RolloutConfig(reward="exact", multi_turn=MultiTurnConfig(
        environment="tools", environment_kwargs={"path": verl_tools}, max_turns=4))
    assert rollout.environment_arguments()["reward"] == "exact"  # the run's reward scores the answer
    assert "reward" not in rollout.multi_turn.environment_kwargs  # worked out, never written into the config
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    fmt = PromptFormat.for_rollout(tmp_path, rollout, byte_tokenizer)
    assert [t["function"]["name"] for t in fmt.template_kwargs["tools"]] == ["add", "weather", "fails", "lookup",
                                                                           "nothing"]
    problem = Problem([{"role": "user", "content": "2+3?"}], "5")
    prompt = byte_tokenizer.decode(fmt.encode(problem))
    assert prompt.startswith("<|im_start|>system\n# Tools\nadd\nweather\nfails\nlookup\nnothing\n")  # listed
    script = ['<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>', "5"]
    episode = scripted_episode(rollout, fmt, problem, script)
    text = byte_tokenizer.decode(episode.response_ids)
    assert text == (script[0] + "<|im_end|>" + "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
                    "<|im_start|>assistant\n" + script[1] + "<|im_end|>")  # the template's newline after <|im_end|>
    assert episode.reward == 1.0 and episode.turns == 2 and episode.info["tool_calls"] == 1.0
    observation = [i for i, m in enumerate(episode.loss_mask) if m == 0]
    assert byte_tokenizer.decode([episode.response_ids[i] for i in observation]).startswith("\n<|im_start|>user")


def test_the_tools_environment_needs_its_file():
    with pytest.raises(ValueError, match="environment_kwargs.path"):
        MultiTurnConfig(environment="tools")
    from services.config import ConfigError, load_config

    with pytest.raises(ConfigError) as said:
        load_config(None, ["actor_rollout_ref.rollout.multi_turn.function_tool_path=my_tools.py"])
    assert "rollout.multi_turn.environment=tools" in str(said.value)
    assert "rollout.multi_turn.environment_kwargs.path=my_tools.py" in str(said.value)



# verl's BaseTool classes, declared in verl's tool config YAML (environment_kwargs.config)
GSM8K_TOOL = '''
from typing import Any, Optional
from uuid import uuid4

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from verl.utils.rollout_trace import rollout_trace_op

LIVE = {}  # instance ids created and not yet released, across the class's instances


class Gsm8kTool(BaseTool):
    """verl's example tool as its users copied it: the answer's reward, a penalty for no progress."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        self.instances = LIVE

    async def create(self, instance_id: Optional[str] = None, ground_truth: Optional[str] = None, **kwargs):
        instance_id = instance_id or str(uuid4())
        if ground_truth is None:
            ground_truth = kwargs.get("create_kwargs", {}).get("ground_truth", None)
        self.instances[instance_id] = {"ground_truth": ground_truth, "reward": 0.0}
        return instance_id, ToolResponse()

    @rollout_trace_op
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs):
        answer = str(parameters.get("answer", ""))
        if answer == "boom":
            raise RuntimeError("the grader is down")
        reward = await self.calc_reward(instance_id, answer=answer)
        return ToolResponse(text=f"Current parsed answer={answer!r} reward={reward}"), reward - 0.05, {}

    async def calc_reward(self, instance_id: str, answer: str = "", **kwargs) -> float:
        return float(answer == self.instances[instance_id]["ground_truth"])

    async def release(self, instance_id: str, **kwargs) -> None:
        del self.instances[instance_id]


class Echo(BaseTool):
    """A tool whose schema comes from the class (verl's tutorial form), with a config setting."""

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return OpenAIFunctionToolSchema(**{"type": "function", "function": {
            "name": "echo", "description": "Says it back.", "parameters": {
                "type": "object", "properties": {"text": {"type": "string", "description": "What."}},
                "required": ["text"]}}, "return": {"type": "string"}})

    leaking = None

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs):
        if parameters["text"] == "picture":
            return ToolResponse(text="here", image=["a picture"]), 0.0, {}
        if parameters["text"] == "a dict reward":
            return ToolResponse(text="x"), {"score": 1.0}, {}
        if parameters["text"] == "leak":
            self.leaking = instance_id
        return ToolResponse(text=self.config["prefix"] + parameters["text"]), None, {}

    async def release(self, instance_id: str, **kwargs) -> None:
        if instance_id == self.leaking:
            raise RuntimeError("cannot release")
'''
GSM8K_SCHEMA = {"type": "function", "function": {
    "name": "calc_gsm8k_reward", "description": "A tool for calculating the reward of gsm8k",
    "parameters": {"type": "object", "properties": {
        "answer": {"type": "string", "description": "The model's answer to the GSM8K math problem"}},
        "required": ["answer"]}}}


@pytest.fixture
def tool_config(tmp_path) -> str:
    (tmp_path / "gsm8k_tools.py").write_text(GSM8K_TOOL)
    config = {"tools": [
        {"class_name": f"{tmp_path / 'gsm8k_tools.py'}.Gsm8kTool", "config": {"type": "native"},
         "tool_schema": GSM8K_SCHEMA},
        {"class_name": f"{tmp_path / 'gsm8k_tools.py'}.Echo", "config": {"type": "native", "prefix": "> "}}]}
    path = tmp_path / "tool_config.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def _call(name: str, **arguments) -> str:
    return '<tool_call>' + json.dumps({"name": name, "arguments": arguments}) + '</tool_call>'


def test_verl_tool_classes_are_called_as_verl_calls_them(tool_config, tmp_path):
    from rollout_workers.environments.tool_classes import load_tool_classes

    before = {name: sys.modules.get(name) for name in ("verl", "verl.tools.base_tool", "verl.tools.function_tool")}
    tools = load_tool_classes(tool_config)  # against etarl's stand-ins (verl's where installed), gone afterwards
    assert {name: sys.modules.get(name) for name in before} == before
    assert tool_schemas(config=tool_config) == [GSM8K_SCHEMA, {"type": "function", "function": {
        "name": "echo", "description": "Says it back.", "parameters": {"type": "object", "properties": {
            "text": {"type": "string", "description": "What."}}, "required": ["text"]}}}]
    module = {type(tool.instance).__module__ for tool in tools.values()}
    assert len(module) == 1  # two classes of one file: the file ran once
    live = sys.modules[module.pop()].LIVE
    reward = tmp_path / "sees_tool_rewards.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return {'score': float(solution_str == ground_truth),\n"
                      "            'seen': len(extra_info['tool_rewards'])}\n")
    env = FunctionTools(config=tool_config, reward=f"{reward}:compute_score", max_parallel_calls=3)
    # the prompt's create_kwargs reach create (a parquet row's struct fills missing keys with None)
    env.reset(Problem("?", "72", extra_info={"tools_kwargs": {
        "calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}, "execute_kwargs": None}, "echo": None}}))
    said = env.step(_call("calc_gsm8k_reward", answer="70") + _call("echo", text="hi")
                    + _call("calc_gsm8k_reward", answer="72"))
    assert [m["content"] for m in said.observation] == [
        "Current parsed answer='70' reward=0.0", "> hi", "Current parsed answer='72' reward=1.0"]
    assert env.tool_rewards == [-0.05, 0.95]  # in the calls' order; echo's None is no reward (as verl)
    failed = env.step(_call("calc_gsm8k_reward", answer="boom") + _call("nope") + _call("echo", text="picture"))
    assert [m["content"] for m in failed.observation] == [
        "Error executing tool 'calc_gsm8k_reward': the grader is down",
        "Unknown function 'nope'. Available tools: ['calc_gsm8k_reward', 'echo']",
        "Error executing tool 'echo': it returned an image or a video; etarl's policies read text only"]
    assert env.tool_rewards[2:] == [0.0, 0.0, 0.0]  # a failed call's reward is 0, as verl's
    assert live == {}  # every instance released, the failed one too
    odd = env.step(_call("echo", text="a dict reward") + _call("echo", text="leak"))
    assert [m["content"] for m in odd.observation] == [
        "Error executing tool 'echo': float() argument must be a string or a real number, not 'dict'",
        "> leak"]  # a release that raises is logged; the call's answer stands
    last = env.step("72")
    assert last.done and last.reward == 1.0
    assert last.info["seen"] == 6 and last.info["tool_errors"] == 4.0 and last.info["tool_calls"] == 8.0


def test_function_tools_and_tool_classes_together_and_per_prompt(tool_config, verl_tools, byte_tokenizer, tmp_path):
    env = FunctionTools(verl_tools, tool_config, reward="exact")
    assert list(env.tools) == ["calc_gsm8k_reward", "echo", "add", "weather", "fails", "lookup", "nothing"]
    env.reset(Problem("?", "5", extra_info={"tool_selection": ["add", "echo", "no_such_tool"]}))
    said = env.step(_call("lookup", key="k"))
    assert said.observation[0]["content"] == "Unknown function 'lookup'. Available tools: ['add', 'echo']"
    rollout = RolloutConfig(reward="exact", multi_turn=MultiTurnConfig(
        environment="tools", environment_kwargs={"path": verl_tools, "config": tool_config}))
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    fmt = PromptFormat.for_rollout(tmp_path, rollout, byte_tokenizer)
    user = [{"role": "user", "content": "2+3?"}]
    assert fmt.render(Problem(user, "5")).startswith(
        "<|im_start|>system\n# Tools\ncalc_gsm8k_reward\necho\nadd\nweather\nfails\nlookup\nnothing\n")
    assert fmt.render(Problem(user, "5", extra_info={"tool_selection": ["echo", "add"]})).startswith(
        "<|im_start|>system\n# Tools\necho\nadd\n<|im_end|>")  # verl's order: the selection's
    clash = tmp_path / "clash.py"
    clash.write_text("def echo(text: str) -> str:\n    '''Echo.\n\n    Args:\n        text: What.\n    '''\n"
                     "    return text\n")
    with pytest.raises(ValueError, match=r"\['echo'\] .* collide with tools declared in"):
        FunctionTools(str(clash), tool_config)


@pytest.mark.parametrize("config, said", [
    ("tools: {a: 1}", "needs `tools:`, a list"),
    ("tools: []", "declares no tool"),
    ("tools: [{class_name: m.C, config: {type: mcp}}]", "config.type is 'mcp': etarl runs native tools only"),
    ("tools: [{class_name: m.C, cfg: {type: native}}]", r"tools\[0\]: cfg: not a key of a tool"),
    ("tools: [{class_name: m.C}]", r"tools\[0\]: needs class_name \(module.Class\) and config"),
    ("tools: [{class_name: NoDot, config: {type: native}}]", r"tools\[0\]: needs class_name \(module.Class\)"),
    ("tools: [{class_name: m.C, config: {type: native, url: '${oc.env:URL}'}}]",
     r"tools\[0\]\.config\.url: '\$\{oc.env:URL\}' is an OmegaConf interpolation"),
    ("tools: [{class_name: no_such_module_xyz.C, config: {type: native}}]",
     "cannot import module 'no_such_module_xyz'"),
    ("tools: [{class_name: 'TOOLS.Missing', config: {type: native}}]", "has no class 'Missing'"),
    ("tools: [{class_name: 'TOOLS.Gsm8kTool', config: {type: native}}]",
     "no tool_schema in the tool config and none from get_openai_tool_schema"),
    ("tools: [{class_name: 'TOOLS.Gsm8kTool', config: {type: native}, tool_schema: {type: function}}]",
     "ValidationError"),
    ("tools: [{class_name: 'TOOLS.Echo', config: {type: native}}, {class_name: 'TOOLS.Echo', config: {type: native}}]",
     "a second tool named 'echo'"),
])
def test_a_bad_tool_config_is_refused_saying_what_is_wrong(tmp_path, config, said):
    from rollout_workers.environments.tool_classes import load_tool_classes

    (tmp_path / "gsm8k_tools.py").write_text(GSM8K_TOOL)
    path = tmp_path / "tool_config.yaml"
    path.write_text(config.replace("TOOLS", str(tmp_path / "gsm8k_tools.py")))
    with pytest.raises(ValueError, match=said):
        load_tool_classes(str(path))


def test_a_prompts_bad_tool_fields_are_named(tool_config, verl_tools, byte_tokenizer, tmp_path):
    env = FunctionTools(verl_tools, tool_config, reward="exact")
    env.reset(Problem("?", "5", extra_info={"tool_selection": "add"}))  # one name, as a list of one
    assert list(env.active_tools) == ["add"]
    with pytest.raises(ValueError, match=r"extra_info.tool_selection is 3: a list of tool names"):
        env.reset(Problem("?", "5", extra_info={"tool_selection": 3}))
    with pytest.raises(ValueError, match=r"extra_info.tools_kwargs is '\{\}', not a mapping .*JSON text is not read"):
        env.reset(Problem("?", "5", extra_info={"tools_kwargs": "{}"}))
    with pytest.raises(ValueError, match=r"extra_info.tools_kwargs\['echo'\] is \{'create_kwargs': 'gt=2'\}"):
        env.reset(Problem("?", "5", extra_info={"tools_kwargs": {"echo": {"create_kwargs": "gt=2"}}}))
    with pytest.raises(ValueError, match=r"tool_selection \['nope'\] names no tool of this run \(calc_gsm8k_reward"):
        env.reset(Problem("?", "5", extra_info={"tool_selection": ["nope"]}))  # verl would show it no tools
    rollout = RolloutConfig(reward="exact", multi_turn=MultiTurnConfig(
        environment="tools", environment_kwargs={"path": verl_tools}))
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    fmt = PromptFormat.for_rollout(tmp_path, rollout, byte_tokenizer)
    user = [{"role": "user", "content": "?"}]
    with pytest.raises(ValueError, match=r"^extra_info.tool_selection is \{'a': 1\}"):  # not "the template failed"
        fmt.render(Problem(user, "5", extra_info={"tool_selection": {"a": 1}}))
    with pytest.raises(ValueError, match=r"^extra_info.tools_kwargs is \['x'\]"):  # so the start finds it
        fmt.render(Problem(user, "5", extra_info={"tools_kwargs": ["x"]}))


def test_a_tool_file_that_imports_what_etarl_does_not_stand_in_for_is_told_why(tmp_path):
    from rollout_workers.environments.tool_classes import load_tool_classes

    for name, source, said in [
            ("copied", "from .base_tool import BaseTool\n", "write `from verl.tools.base_tool import BaseTool`"),
            ("scored", "from verl.utils.reward_score import sandbox_fusion\n",
             "anything else of verl needs verl installed"),
            ("named", "from verl.tools.schemas import OpenAIFunctionToolCall\n", "anything else of verl needs")]:
        (tmp_path / f"{name}.py").write_text(source)
        config = tmp_path / f"{name}.yaml"
        config.write_text(yaml.safe_dump({"tools": [{"class_name": f"{tmp_path / name}.py.T",
                                                     "config": {"type": "native"}}]}))
        with pytest.raises(ValueError, match=re.escape(said)):
            load_tool_classes(str(config))


def test_verl_tool_config_path_becomes_the_tools_environments_config(tmp_path):
    from services.config import ConfigError, load_config

    with pytest.raises(ValueError, match="environment_kwargs.path.*or both"):
        MultiTurnConfig(environment="tools", environment_kwargs={"config": 3})
    with pytest.raises(ConfigError) as said:
        load_config(None, ["actor_rollout_ref.rollout.multi_turn.tool_config_path=tool_config.yaml"])
    assert "rollout.multi_turn.environment=tools" in str(said.value)
    assert "rollout.multi_turn.environment_kwargs.config=tool_config.yaml" in str(said.value)


def test_the_agent_loop_runs_tool_classes_in_the_environments_processes(tool_config, byte_tokenizer, tmp_path):
    rollout = RolloutConfig(reward="exact", multi_turn=MultiTurnConfig(
        environment="tools", environment_kwargs={"config": tool_config}, max_turns=3))
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    fmt = PromptFormat.for_rollout(tmp_path, rollout, byte_tokenizer)
    problem = Problem([{"role": "user", "content": "2+3?"}], "5", extra_info={
        "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "5"}}}})
    episode = scripted_episode(rollout, fmt, problem, [_call("calc_gsm8k_reward", answer="5"), "5"])
    assert "<tool_response>\nCurrent parsed answer='5' reward=1.0\n" in byte_tokenizer.decode(episode.response_ids)
    assert episode.reward == 1.0 and episode.info["tool_reward"] == pytest.approx(0.95)


def test_a_run_checks_its_tool_config_at_start_and_every_node_must_read_it(tool_config, byte_tokenizer, tmp_path):
    from services.config import ConfigError, build_config
    from services.inputs import check_environment
    from services.shared_paths import run_paths

    def run(config: str):
        return build_config({"rollout": {"reward": "exact", "multi_turn": {
            "environment": "tools", "environment_kwargs": {"config": config}}}})

    fmt = PromptFormat(byte_tokenizer, stop_token_ids=(byte_tokenizer.eos_token_id,))
    check_environment(run(tool_config), fmt)
    assert run_paths(run(tool_config), tmp_path)["rollout.multi_turn.environment_kwargs.config"] == tool_config
    bad = tmp_path / "bad.yaml"
    bad.write_text("tools: [{class_name: m.C, config: {type: mcp}}]")
    with pytest.raises(ConfigError, match=r"^rollout.multi_turn: tool config .*bad.yaml.*native tools only"):
        check_environment(run(str(bad)), fmt)


def test_tool_classes_of_an_importable_module_load_and_travel_with_the_job(tmp_path, monkeypatch):
    from rollout_workers.environments.tool_classes import load_tool_classes
    from services.config import build_config
    from services.inputs import ray_runtime_env

    (tmp_path / "travelling_tools_mod.py").write_text(GSM8K_TOOL)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    monkeypatch.delenv("RAY_OVERRIDE_JOB_RUNTIME_ENV", raising=False)
    config = tmp_path / "tool_config.yaml"
    config.write_text(yaml.safe_dump({"tools": [{"class_name": "travelling_tools_mod.Gsm8kTool",
                                                 "config": {"type": "native"}, "tool_schema": GSM8K_SCHEMA}]}))
    assert list(load_tool_classes(str(config))) == ["calc_gsm8k_reward"]  # verl's form: module.Class
    cfg = build_config({"rollout": {"reward": "exact", "multi_turn": {
        "environment": "tools", "environment_kwargs": {"config": str(config)}}}})
    assert ray_runtime_env(cfg) == {"py_modules": [str(tmp_path / "travelling_tools_mod.py")]}


def test_verls_multi_turn_keys_are_answered():
    from services.verl_keys import translate

    lines, etarl = translate([("actor_rollout_ref.rollout.multi_turn.max_user_turns", 2),
                              ("actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode", "strict")])
    assert etarl == ["rollout.multi_turn.environment_kwargs.max_tool_turns=2"]
    assert "tokenization_sanity_check_mode: no etarl key: etarl never re-tokenizes a trajectory" in lines[1]
    lines, etarl = translate([("actor_rollout_ref.rollout.multi_turn.max_user_turns", 0)])  # verl's 0: no limit
    assert etarl == [] and "0 has no etarl form" in lines[0]


def test_the_gsm8k_tool_example_takes_its_answer_from_a_verl_row(monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # the example's class_name is a path from here
    env = FunctionTools(config="examples/gsm8k_tool_config.yaml", reward="gsm8k")
    row = {"tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "1072"}}}}
    env.reset(Problem([{"role": "user", "content": "How many?"}], "1072", extra_info=row))
    wrong = env.step(_call("calc_gsm8k_reward", answer="1,072"))  # verl's flexible rule keeps the comma
    right = env.step(_call("calc_gsm8k_reward", answer="1072"))
    assert [wrong.observation[0]["content"], right.observation[0]["content"]] == [
        "Current parsed answer='1,072' reward=0.0", "Current parsed answer='1072' reward=1.0"]
    assert env.tool_rewards == [-0.05, 0.0]
    last = env.step("The answer is\n#### 1072")
    assert last.done and last.reward == 1.0


LOOP_BOUND = """
import asyncio

from verl.tools.base_tool import BaseTool, ToolResponse


class LoopBound(BaseTool):
    def __init__(self, config, tool_schema):
        super().__init__(config, tool_schema)
        self.loop = asyncio.get_event_loop()  # what a client session made here would belong to

    async def execute(self, instance_id, parameters, **kwargs):
        return ToolResponse(text=str(asyncio.get_running_loop() is self.loop)), None, {}
"""


def test_a_class_that_takes_the_loop_when_built_is_called_on_that_loop(tmp_path):
    (tmp_path / "loop_bound.py").write_text(LOOP_BOUND)
    config = tmp_path / "tool_config.yaml"
    config.write_text(yaml.safe_dump({"tools": [{"class_name": f"{tmp_path / 'loop_bound.py'}.LoopBound",
                                                 "config": {"type": "native"}, "tool_schema": {
                                                     "type": "function", "function": {"name": "bound",
                                                                                      "description": "Is it?"}}}]}))
    env = FunctionTools(config=str(config), reward="exact")
    env.reset(Problem("?", "True"))
    assert env.step(_call("bound")).observation == [{"role": "tool", "content": "True"}]


def test_a_tool_module_whose_code_fails_on_import_is_refused_saying_why(tmp_path, monkeypatch):
    from rollout_workers.environments.tool_classes import load_tool_classes

    (tmp_path / "needs_a_key_mod.py").write_text("raise RuntimeError('SANDBOX_URL is not set')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = tmp_path / "tool_config.yaml"
    config.write_text(yaml.safe_dump({"tools": [{"class_name": "needs_a_key_mod.T", "config": {"type": "native"}}]}))
    with pytest.raises(ValueError, match=r"tools\[0\]: .*importing 'needs_a_key_mod' failed: RuntimeError: SAND"):
        load_tool_classes(str(config))


QWEN3_CODER_TURN = """Let me add them.
<tool_call>
<function=add>
<parameter=a>
2
</parameter>
<parameter=b>
3
</parameter>
</function>
</tool_call>"""


def test_qwen3_coder_calls_are_read_with_their_parameters_typed_by_the_schema():
    from rollout_workers.environments.tool_calls import parsed_calls

    schemas = {"f": {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer"}, "x": {"type": "number"}, "ok": {"type": "boolean"}, "o": {"type": "object"},
        "items": {"type": "array"}, "s": {"type": "string"}, "bad": {"type": "integer"}}}}}}

    def call(**params) -> str:
        return "<tool_call>\n<function=f>\n" + "".join(
            f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items()) + "</function>\n</tool_call>"

    assert parsed_calls(call(n="7", x="2.0", ok="True", o='{"k": [1]}', items="[1, 'a']", s="42", bad="4.5",
                             other="null", extra="12"), "qwen3_coder", schemas) == [
        ("f", {"n": 7, "x": 2, "ok": True, "o": {"k": [1]}, "items": [1, "a"], "s": "42", "bad": "4.5",
               "other": None, "extra": "12"})]  # not in the schema: text; "null": None
    assert parsed_calls(call(x="inf", items="[true]"), "qwen3_coder", schemas) == [
        ("f", {"x": "inf", "items": "[true]"})]  # what does not convert stays text, as in verl
    # a turn cut at its token limit: the open block and parameter still count; a name never closed does not
    assert parsed_calls("<tool_call>\n<function=f>\n<parameter=n>\n5", "qwen3_coder", schemas) == [("f", {"n": 5})]
    assert parsed_calls("<tool_call>\n<function=f", "qwen3_coder", schemas) == []
    assert parsed_calls(QWEN3_CODER_TURN, "hermes") == []  # each format reads its own
    assert parsed_calls('<tool_call>{"name": "f", "arguments": {}}</tool_call>', "qwen3_coder") == []
    with pytest.raises(ValueError, match="tool call format 'json': etarl reads hermes, qwen3_coder"):
        parsed_calls("", "json")


def test_the_tools_environment_reads_qwen3_coder_calls(verl_tools):
    env = FunctionTools(verl_tools, reward="exact", format="qwen3_coder")
    env.reset(Problem("2+3?", "5"))
    said = env.step(QWEN3_CODER_TURN)
    assert said.observation == [{"role": "tool", "content": "5"}]  # a and b typed as the signature's ints
    assert env.step("5").reward == 1.0
    with pytest.raises(ValueError, match="format must be hermes or qwen3_coder"):
        FunctionTools(verl_tools, format="xml")
    from services.verl_keys import translate

    assert translate([("actor_rollout_ref.rollout.multi_turn.format", "qwen3_coder")])[1] == [
        "rollout.multi_turn.environment_kwargs.format=qwen3_coder"]
    assert "no etarl form" in translate([("actor_rollout_ref.rollout.multi_turn.format", "gpt-oss")])[0][0]


@pytest.mark.parametrize("shows, call_format, warned", [
    ("", "hermes", "does not show the tools to the model"),
    ("{{ t['function']['name'] }}", "hermes", "writes no <tool_call> where it lists the tools: the tools "
                                              "environment reads hermes calls"),
    ("{{ t['function']['name'] }} <tool_call>{json}</tool_call>", "hermes", None),
    ("{{ t['function']['name'] }} <tool_call>{json}</tool_call>", "qwen3_coder",
     "teaches hermes tool calls but the tools environment reads qwen3_coder ones: set "
     "rollout.multi_turn.environment_kwargs.format=hermes"),
    ("{{ t['function']['name'] }} <tool_call><function=name>", "hermes", "teaches qwen3_coder tool calls"),
    ("{{ t['function']['name'] }} <tool_call><function=name>", "qwen3_coder", None),
])
def test_the_start_warns_where_the_template_hides_the_tools_or_teaches_another_form(
        verl_tools, byte_tokenizer, tmp_path, caplog, shows, call_format, warned):
    import logging

    from services.inputs import _check_tools_template

    template = tmp_path / "template.jinja"
    template.write_text("{%- for t in tools %}" + shows + "{% endfor %}{%- for m in messages %}{{ m['content'] }}"
                        "{%- endfor %}")
    fmt = PromptFormat(byte_tokenizer, chat_template=str(template),
                       template_kwargs={"tools": tool_schemas(verl_tools)})
    with caplog.at_level(logging.WARNING, logger="etarl"):
        _check_tools_template(fmt, call_format)
    assert (warned in caplog.text) if warned else caplog.text == ""
