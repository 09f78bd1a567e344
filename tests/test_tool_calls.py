"""Tool calling in GRPO/RLOO rollouts (`alignpipe.tool_calls`): the suffix ids and the parsed calls equal TRL 1.16's,
a rollout's tool answers sit in its completions but out of the loss, the budget rules are TRL's, and a recipe offers
tools through its format stage."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, Literal

import pytest
import torch
from support import experiment_id, known

from alignpipe.data.formats import format_rows
from alignpipe.engine.base import Generation
from alignpipe.engine.sampling import SamplingParams
from alignpipe.judges.reward_set import LoadedReward, RewardSet
from alignpipe.modeling import load_causal_lm, load_tokenizer
from alignpipe.tool_calls import (
    ToolCallParser,
    ToolError,
    ToolRunner,
    check_template,
    load_tools,
    run_calls,
    tool_schema,
    tool_suffix_ids,
    tool_turns,
)
from alignpipe.tracking import Tracker
from alignpipe.trainers import grpo, rloo
from alignpipe.trainers.configs import GRPOConfig, RLOOConfig

# A Hermes-style template for the tiny tokenizer: tools as JSON in a system turn, calls as <tool_call> blocks, tool
# answers as a `tool` turn (what Qwen2.5/Qwen3's templates do, in the tiny tokenizer's markers).
TOOL_TEMPLATE = (
    "{%- if tools %}<|system|>Tools:{% for t in tools %} {{ t | tojson }}{% endfor %}<|end|>{% endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' and m.get('tool_calls') -%}"
    "<|assistant|>{{ m['content'] }}{% for c in m['tool_calls'] %}<tool_call>"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}</tool_call>"
    "{% endfor %}<|end|>"
    "{%- elif m['role'] == 'tool' -%}<|tool|>{{ m['content'] }}<|end|>"
    "{%- else -%}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif -%}"
)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


async def slow_double(x: int) -> int:
    """Double a number, slowly.

    Args:
        x: The number.
    """
    await asyncio.sleep(0.2)
    return 2 * x


def broken(x: int) -> int:
    """Always fails.

    Args:
        x: Anything.
    """
    raise RuntimeError("no luck")


@pytest.fixture(scope="module")
def tok(tiny):
    t = load_tokenizer(str(tiny / "model"))
    t.chat_template = TOOL_TEMPLATE
    return t


def call_text(name: str, **args) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


class Scripted:
    """An engine that writes by rule: a first turn calls `add(a=2, b=<3 or 4 by sample>)`; after a tool answer it
    writes `sum <the answer>`. `always_call`: every turn calls again. Log-probs: −0.5 a token."""

    def __init__(self, tok, always_call: bool = False, first: str | None = None):
        self.tok, self.always_call, self.first = tok, always_call, first
        self.contexts: list[list[int]] = []

    def update_weights(self, model):
        pass

    def generate(self, prompts, n=1, sampling=None, seed=None, logprobs=False):
        out = []
        for i, p in enumerate(prompts):
            self.contexts.append(list(p))
            context = self.tok.decode(p, skip_special_tokens=False)
            for j in range(n):
                if "<|tool|>" in context and not self.always_call:
                    text = "sum " + context.rsplit("<|tool|>", 1)[1].split("<|end|>")[0]
                else:
                    text = self.first or call_text("add", a=2, b=3 + (i * n + j) % 2)
                ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
                ids = ids[: sampling.max_new_tokens]
                reason: Literal["stop", "length"] = "stop" if ids[-1] == self.tok.eos_token_id else "length"
                text = self.tok.decode(ids, skip_special_tokens=True)
                out.append(Generation(i, text, ids, reason, [-0.5] * len(ids) if logprobs else None))
        return out


def encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_the_suffix_ids_equal_trls(tok):
    trl = pytest.importorskip("trl")
    stub = SimpleNamespace(processing_class=tok, chat_template=None, chat_template_kwargs={}, _is_vlm=False,
                           _tokenizer=tok)  # fmt: skip
    for messages in (
        [{"role": "tool", "name": "add", "content": "5"}],
        [{"role": "tool", "name": "add", "content": "7"}, {"role": "tool", "name": "mul", "content": "{'x': 1}"}],
    ):
        ours = tool_suffix_ids(tok, messages)
        assert ours == trl.GRPOTrainer._get_tool_suffix_ids(stub, messages)
        assert tok.decode(ours, skip_special_tokens=False).startswith("<|tool|>")
        assert tok.decode(ours, skip_special_tokens=False).endswith("<|end|><|assistant|>")


def test_hermes_calls_parse_as_trls_qwen3_parser_reads_them(tok):
    """TRL's `parse_response` with its Qwen3 response template (transformers' parser) and ours find the same calls;
    a malformed call leaves the turn plain text in both."""
    chat_utils = pytest.importorskip("trl.chat_template_utils")
    theirs_tok = load_tokenizer(tok.name_or_path)
    theirs_tok.response_template = chat_utils.qwen3_template
    ours = ToolCallParser(tok, "hermes")
    turns = [
        '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>',
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "mul", "arguments": {"x": "y"}}\n</tool_call>',
        "no call here",
        '<tool_call>\n{"name": "add", "argu</tool_call>',
    ]
    for text in turns:
        ids = encode(tok, text) + [tok.eos_token_id]
        a, b = ours(ids), chat_utils.parse_response(theirs_tok, ids, prefix=[])
        assert a.get("tool_calls") == b.get("tool_calls"), text
        if "tool_calls" not in a:
            assert a["content"] == b["content"], text


def test_the_parser_reads_content_string_arguments_and_the_tokenizers_own_parser(tok):
    parser = ToolCallParser(tok, "auto")
    assert parser.fmt == "hermes"
    msg = parser(
        encode(tok, 'Let me add. <tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>')
    )
    assert msg == {
        "role": "assistant",
        "content": "Let me add.",
        "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}],
    }
    with pytest.raises(ToolError, match="response schema or template"):
        ToolCallParser(tok, "tokenizer")
    chat_utils = pytest.importorskip("trl.chat_template_utils")
    own = load_tokenizer(tok.name_or_path)
    own.response_template = chat_utils.qwen3_template
    parser = ToolCallParser(own, "auto")
    assert parser.fmt == "tokenizer"
    ids = encode(tok, '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>') + [tok.eos_token_id]
    assert parser(ids, []) == chat_utils.parse_response(own, ids, prefix=[])


def test_calls_run_as_trls_do():
    """Sync and async tools (the async ones of a turn concurrently); an unknown tool or an exception answers
    {"error": ...} and counts as a failure, with TRL's messages."""

    def call(name, **args):
        return {"type": "function", "function": {"name": name, "arguments": args}}

    tools: dict[str, Callable[..., Any]] = {"add": add, "slow_double": slow_double, "broken": broken}
    calls = [
        call("add", a=1, b=2),
        call("slow_double", x=4),
        call("slow_double", x=5),
        call("nope"),
        call("broken", x=1),
    ]
    started = time.monotonic()
    messages, failures = run_calls(calls, tools)
    elapsed = time.monotonic() - started
    assert [m["content"] for m in messages] == [
        "3",
        "8",
        "10",
        "{'error': 'Tool nope not found.'}",
        "{'error': 'no luck'}",
    ]
    assert [m["name"] for m in messages] == ["add", "slow_double", "slow_double", "nope", "broken"]
    assert all(m["role"] == "tool" for m in messages)
    assert failures == 2
    assert elapsed < 0.39, "the two async calls ran concurrently"
    _, failures = run_calls([call("add", a=1)], tools)  # a missing argument
    assert failures == 1


PLAIN_TEMPLATE = (  # renders the content of every turn and nothing else (as many base models' templates)
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def plain_tokenizer(tiny):
    t = load_tokenizer(str(tiny / "model"))
    t.chat_template = PLAIN_TEMPLATE
    return t


def test_the_template_check_refuses_templates_without_tool_turns(tiny, tok):
    check_template(tok)
    check_template(load_tokenizer(str(tiny / "model")))  # the tiny tokenizer's own template renders tool turns
    with pytest.raises(ToolError, match="drops part of a tool exchange"):
        check_template(plain_tokenizer(tiny))


def test_tools_need_hints_and_docstrings():
    def undocumented(x):
        return x

    with pytest.raises(ToolError, match="type hints on every parameter and a docstring"):
        tool_schema(undocumented)
    assert tool_schema(add)["function"]["parameters"]["required"] == ["a", "b"]
    assert load_tools(["test_tool_calls:add"]) == [add]
    with pytest.raises(ToolError, match="no callable 'nothing'"):
        load_tools(["test_tool_calls:nothing"])


def turns(tok, engine, max_completion_length=160, **kwargs):
    prompts = [encode(tok, f"<|user|>add 2 and {k}<|end|><|assistant|>") for k in (3, 4)]
    repeated = [p for p in prompts for _ in range(2)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=max_completion_length)
    gens = engine.generate(prompts, 2, sampling, logprobs=True)
    parser = ToolCallParser(tok)
    return (
        repeated,
        gens,
        tool_turns(engine, repeated, gens, sampling, [add], parser, max_completion_length, logprobs=True, **kwargs),
    )


def test_a_tool_turn_appends_the_answer_and_the_continuation(tok):
    engine = Scripted(tok)
    prompts, gens, out = turns(tok, engine)
    assert out.calls == 4 and out.failures == 0
    for i, (g, ids, mask) in enumerate(zip(gens, out.completion_ids, out.tool_mask, strict=True)):
        result = 2 + 3 + i % 2
        suffix = tool_suffix_ids(tok, [{"role": "tool", "name": "add", "content": str(result)}])
        tail = encode(tok, f"sum {result}") + [tok.eos_token_id]
        assert ids == g.completion_ids + suffix + tail
        assert mask == [1] * len(g.completion_ids) + [0] * len(suffix) + [1] * len(tail)
        assert out.logprobs[i] == [-0.5] * len(g.completion_ids) + [0.0] * len(suffix) + [-0.5] * len(tail)
        assert out.answers[i] == f"sum {result}"
        assert [m["role"] for m in out.messages[i]] == ["assistant", "tool", "assistant"]
        assert out.messages[i][0]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 2, "b": 3 + i % 2}}
        assert out.ended[i]
    # the continuation was sampled from prompt + first turn + tool answer, as ids (never re-tokenized text)
    tails = [len(encode(tok, a)) + 1 for a in out.answers]
    assert engine.contexts[-4:] == [p + ids[: len(ids) - n] for p, ids, n in zip(prompts, out.completion_ids, tails)]


def test_an_answer_that_does_not_fit_is_dropped_and_a_cut_continuation_has_not_ended(tok):
    first = len(encode(tok, call_text("add", a=2, b=3))) + 1
    suffix = len(tool_suffix_ids(tok, [{"role": "tool", "name": "add", "content": "5"}]))
    _, gens, out = turns(tok, Scripted(tok), max_completion_length=first + suffix - 1)
    assert out.completion_ids == [g.completion_ids for g in gens]  # rolled back, as TRL
    assert out.ended == [True] * 4 and out.calls == 4
    assert [len(m) for m in out.messages] == [1] * 4
    _, gens, out = turns(tok, Scripted(tok), max_completion_length=first + suffix + 1)
    assert all(len(ids) == first + suffix + 1 for ids in out.completion_ids)
    assert out.ended == [False] * 4
    _, gens, out = turns(tok, Scripted(tok), window=len(gens[0].completion_ids) + 10)
    assert out.completion_ids == [g.completion_ids for g in gens]  # past the model's positions


def test_max_tool_calling_iterations_stops_a_model_that_keeps_calling(tok):
    _, _, out = turns(tok, Scripted(tok, always_call=True), max_completion_length=400, max_iterations=2)
    assert out.calls == 4 * 3 - 4  # the first call and one more per completion were answered; the third was not
    assert all(len(m) == 5 for m in out.messages)  # call, answer, call, answer, call
    assert all(m[-1].get("tool_calls") for m in out.messages)


@pytest.fixture(scope="module")
def tool_rows(tiny, tok):
    raw = [{"prompt": f"add 2 and {k}", "answer": str(2 + k)} for k in range(3, 11)]
    train, _, _ = format_rows(raw, fmt="prompt_only", tokenizer=tok, chat_template=True, tools=[tool_schema(add)],
                              eval_fraction=0.0, shuffle=False)  # fmt: skip
    return train


def test_prompts_show_the_tools(tool_rows):
    assert '"name": "add"' in tool_rows[0]["prompt"] and "The first number." in tool_rows[0]["prompt"]


def answered_five(prompts, completions, completion_messages, **_):
    return [float(c == "sum 5" and m[1]["content"] == "5") for c, m in zip(completions, completion_messages)]


def test_sampled_rollouts_mask_the_tool_answers(tiny, tok, tool_rows):
    cfg = GRPOConfig(batch_size=4, num_generations=2, max_completion_length=160)
    generated = []
    loop = SimpleNamespace(
        step=1,
        unwrapped=None,
        count=lambda *a: None,
        count_generation=lambda *a: generated.append(a),
        count_sync=lambda *a: None,
    )
    engine = Scripted(tok)
    run: Any = SimpleNamespace(cfg=cfg, loop=loop, tokenizer=tok, engine=engine, seed=0,
                          encode_prompts=lambda rows: grpo.prompt_ids(tok, rows, None),
                          tools=ToolRunner([add], ToolCallParser(tok), 160))  # fmt: skip
    sm = grpo.sample(run, tool_rows[:2], logprobs=True)
    assert sm.tool_mask is not None and sm.messages is not None
    tools, sampling_logps = known(sm.tools), known(sm.sampling_logps)
    for i in range(4):
        n = int(sm.lengths[i])
        expected = torch.tensor(tools.tool_mask[i], dtype=torch.float)
        assert torch.equal(sm.mask[i, :n], expected)
        assert sm.mask[i, n:].sum() == 0
        assert torch.equal(sampling_logps[i, :n], torch.tensor(known(tools.logprobs)[i]))
    assert sm.completions == ["sum 5", "sum 6", "sum 5", "sum 6"]
    fields = sm.tool_fields()
    assert fields["tool_stats"] == {"tools/call_frequency": 1.0, "tools/failure_frequency": 0.0}
    [(seconds, sampled)] = generated  # one rollout: its rounds' wall time and the sampled tokens, tool answers not
    assert seconds > 0 and sampled == sum(sum(row) for row in tools.tool_mask) < int(sm.lengths.sum())


@pytest.mark.parametrize("trainer", ["grpo", "rloo"])
def test_a_run_calls_the_tools_and_trains_on_the_sampled_tokens(tiny, tok, tool_rows, tmp_path, trainer):
    model = load_causal_lm(str(tiny / "model"))
    common = dict(learning_rate=1e-3, max_steps=2, batch_size=4, num_generations=2, max_completion_length=160,
                  logging_every=1, sample_every=100)  # fmt: skip
    cfg = GRPOConfig(**common) if trainer == "grpo" else RLOOConfig(**common, beta=0.0)
    tracker = Tracker()
    rewards = RewardSet([LoadedReward("answered_five", answered_five)])
    train = grpo.train if trainer == "grpo" else rloo.train
    train(cfg, model, tok, tool_rows, rewards, tracker, tmp_path, engine=Scripted(tok), eval_rows=tool_rows[:1],
          tools=[add])  # fmt: skip
    assert tracker.series("train/tools/call_frequency") == [1.0, 1.0]
    assert tracker.series("train/tools/failure_frequency") == [0.0, 0.0]
    assert tracker.series("train/reward") == [0.5, 0.5]
    first = len(encode(tok, call_text("add", a=2, b=3))) + 1
    sampled = first + len(encode(tok, "sum 5")) + 1  # the tool's answer does not count as generated
    assert tracker.series("train/completions/mean_length")[0] == pytest.approx(sampled, abs=1)
    assert tracker.series("train/grad_norm")[0] > 0
    assert tracker.series("eval/reward")[-1] == 1.0  # greedy eval calls the tool too (its one prompt: 2 + 3)


def test_without_a_tool_template_a_run_is_refused(tiny, tool_rows, tmp_path):
    plain = plain_tokenizer(tiny)
    model = load_causal_lm(str(tiny / "model"))
    cfg = GRPOConfig(max_steps=1, batch_size=4, num_generations=2, max_completion_length=8)
    rewards = RewardSet([LoadedReward("answered_five", answered_five)])
    with pytest.raises(ToolError, match="drops part of a tool exchange"):
        grpo.train(cfg, model, plain, tool_rows, rewards, Tracker(), tmp_path, engine=Scripted(plain), tools=[add])


def test_async_tools_run_inside_a_running_event_loop():
    """A rollout called from async code (a notebook, an async task runner) still runs async tools."""

    async def main():
        return run_calls([{"type": "function", "function": {"name": "slow_double", "arguments": {"x": 3}}}],
                         {"slow_double": slow_double})  # fmt: skip

    messages, failures = asyncio.run(main())
    assert messages[0]["content"] == "6" and failures == 0


TOOLS_MODULE = '''
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b
'''


def tools_recipe(tiny, tmp_path) -> str:
    (tmp_path / "tools.jinja").write_text(TOOL_TEMPLATE)
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"add 2 and {k}", "answer": str(2 + k)}) + "\n" for k in range(20)))
    return (
        f"name: tools\nworkdir: {tmp_path / 'runs'}\n"
        f"model: {{path: {tiny / 'model'}, chat_template: {tmp_path / 'tools.jinja'}}}\n"
        f"datasets: {{sums: {{path: {data}}}}}\nstages:\n"
        "  - {id: data, kind: format, dataset: sums, format: prompt_only, chat_template: true,\n"
        "     tools: ['calc_tools:add']}\n"
        "  - {id: rl, kind: grpo, data: data, rewards: [{function: exact_match}], max_steps: 1, batch_size: 4,\n"
        "     num_generations: 2, max_completion_length: 8, beta: 0.0, logging_every: 1, max_tool_calling_iterations: 2}\n"
        "  - {id: judge, kind: judge, candidate: rl, baseline: base, prompts: data, num_prompts: 4,\n"
        "     reward: exact_match, sampling: {temperature: 0, max_new_tokens: 8}}\n"
    )


def test_a_recipe_offers_tools_through_its_format_stage(prefect_harness, tiny, tmp_path, monkeypatch):
    """format (tools rendered into the prompts) → grpo (the tools loaded from the format stage and called in its
    rollouts): the pipeline runs as users start it, each stage in its own process."""
    from mlflow.tracking import MlflowClient

    from alignpipe.recipe import load_recipe
    from flows.pipeline import pipeline

    (tmp_path / "calc_tools.py").write_text(TOOLS_MODULE)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    path = tmp_path / "tools.yaml"
    path.write_text(tools_recipe(tiny, tmp_path))
    state = pipeline(recipe_path=str(path), return_state=True)
    assert state.is_completed(), state.message
    recipe = load_recipe(path)
    client = MlflowClient(recipe.tracking_uri)
    (run,) = client.search_runs([experiment_id(client, "tools")], "tags.alignpipe.stage_id = 'rl'")
    assert "train/tools/call_frequency" in run.data.metrics  # the random model rarely calls; the path ran
    (judge,) = client.search_runs([experiment_id(client, "tools")], "tags.alignpipe.stage_id = 'judge'")
    assert "judge/win_rate" in judge.data.metrics
    rows = (recipe.run_root / "stages").rglob("*.arrow")
    assert any(b'"name": "add"' in p.read_bytes() for p in rows), "the prompts carry the tool's schema"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tools: ['calc_tools:add']", "set `chat_template: true`"),
        ("chat_template: true, tools: ['calc tools']", "is not `package.module:function`"),
        ("chat_template: true, tools: ['m:add', 'm:add']", "each tool is listed once"),
    ],
)
def test_bad_tool_lists_are_refused_where_they_are_written(tiny, tmp_path, text, message):
    from alignpipe.recipe import RecipeError, parse_recipe

    recipe = (
        f"name: t\nworkdir: {tmp_path}\nmodel: {{path: {tiny / 'model'}}}\n"
        f"datasets: {{d: {{path: {tiny / 'data' / 'reverse.jsonl'}}}}}\n"
        f"stages:\n  - {{id: data, kind: format, dataset: d, format: prompt_only, {text}}}\n"
    )
    with pytest.raises(RecipeError, match=message) as err:
        parse_recipe(recipe)
    assert "stages[0]" in str(err.value) or "data" in str(err.value)


def test_a_stage_that_cannot_answer_calls_is_refused_tool_prompts(tiny, tmp_path):
    from alignpipe.recipe import RecipeError, parse_recipe

    text = tools_recipe(tiny, tmp_path).split("  - {id: rl")[0]  # format only, then:
    text += "  - {id: rl, kind: online_dpo, data: data, rewards: [{function: exact_match}], max_steps: 1}\n"
    with pytest.raises(RecipeError, match="does not run tool calls") as err:
        parse_recipe(text)
    assert "stages[1].data" in str(err.value)


def calls_b3(prompts, completions, **_):
    return [float('"b": 3' in c) for c in completions]


@pytest.mark.parametrize("with_tools", [True, False])
def test_num_generations_eval_scores_sampled_completions_as_trl(tiny, tok, tool_rows, tmp_path, with_tools):
    """With `num_generations_eval: 2` the held-out score is the mean over two sampled completions a prompt (the
    scripted engine's samples alternate between b = 3 and b = 4: reward 1 and 0), with its std and each function's
    mean; without it, one greedy completion (b = 3 for the one prompt: 1.0)."""
    model = load_causal_lm(str(tiny / "model"))
    reward = LoadedReward("answered_five", answered_five) if with_tools else LoadedReward("calls_b3", calls_b3)
    name = reward.name
    trackers = {}
    for n in (None, 2):
        cfg = GRPOConfig(learning_rate=1e-3, max_steps=2, batch_size=4, num_generations=2, max_completion_length=160,
                         eval_every=1, num_generations_eval=n, logging_every=1, sample_every=100)  # fmt: skip
        trackers[n] = Tracker()
        grpo.train(cfg, model, tok, tool_rows, RewardSet([reward]), trackers[n], tmp_path / str(n),
                   engine=Scripted(tok), eval_rows=tool_rows[:1], tools=[add] if with_tools else None)  # fmt: skip
    sampled, greedy = trackers[2], trackers[None]
    assert sampled.series("eval/reward") == [0.5, 0.5]
    assert sampled.series("eval/reward_std") == [pytest.approx(2**-0.5)] * 2
    assert sampled.series(f"eval/rewards/{name}/mean") == [0.5, 0.5]
    assert greedy.series("eval/reward") == [1.0, 1.0]
    assert not greedy.series("eval/reward_std")


def test_the_calculator_does_arithmetic_and_nothing_else():
    from alignpipe.builtin_tools import calculator

    assert calculator("(48 - 12) * 3 / 4") == "27"
    assert calculator("7 / 2") == "3.5" and calculator("2^10") == "1024" and calculator("1,000 + 1") == "1001"
    assert calculator("-3**2") == "-9" and calculator("17 // 5 + 17 % 5") == "5"
    for bad, message in [
        ("__import__('os').system('true')", "not arithmetic"),
        ("x + 1", "not arithmetic"),
        ("9**9**9", "exponent 387420489 is too large"),
        ("((10**64)**64)**64", "more than 4096 bits"),
    ]:
        with pytest.raises(ValueError, match=message):
            calculator(bad)
    messages, failures = run_calls(
        [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": "1/0"}}}],
        {"calculator": calculator},
    )
    assert failures == 1 and messages[0]["content"] == "{'error': 'division by zero'}"  # the model sees why
    assert load_tools(["alignpipe.builtin_tools:calculator"]) == [calculator]
