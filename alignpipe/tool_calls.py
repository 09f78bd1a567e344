"""Tool calling inside rollouts (TRL GRPOTrainer's `tools`): the model writes a tool call, the tool runs, its result
goes back into the conversation and the model goes on, until it answers without a call.

How a rollout with tools is built (`tool_turns`), after the engine's first turn for every completion:
    1. Parse the turn's tool calls (`ToolCallParser`: Hermes/Qwen `<tool_call>{json}</tool_call>` blocks, or the
       tokenizer's own response parser). A turn that ended without EOS (cut at the length limit) calls nothing.
    2. Run each call (sync or async functions; an unknown tool or an exception becomes `{"error": ...}` as the
       tool's answer and counts as a failure).
    3. Append the tool messages as the chat template renders them after an assistant turn (`tool_suffix_ids`:
       the ids, never re-tokenized text, so the trained tokens are the sampled ones), and generate one continuation.
    4. Repeat for the completions that called again, at most `max_iterations` times.
The tool results' tokens are part of the completion but not of the loss: `tool_mask` is 0 on them. A result that
would push a completion past `max_completion_length` (or the model's window) is dropped and the completion ends
with its call, as TRL does.

Tools are plain Python functions with type hints and a Google-style docstring (`Args:`), which the chat template
renders into the prompt as JSON schemas (transformers' `get_json_schema`).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

ToolCallFormat = Literal["auto", "hermes", "tokenizer"]


class ToolError(ValueError):
    """A tool list or chat template that cannot run tool calls, with what to change."""


def load_tools(specs: list[str]) -> list[Callable]:
    """Import each `package.module:function`; a ToolError names a spec that does not resolve or is unusable."""
    from alignpipe.user_code import import_callable

    tools = []
    for spec in specs:
        try:
            fn = import_callable(spec, "tool")
        except ValueError as e:
            raise ToolError(str(e)) from None
        tool_schema(fn, spec)  # a function the template cannot describe fails here, named
        tools.append(fn)
    names = [t.__name__ for t in tools]
    if len(set(names)) != len(names):
        raise ToolError(f"tool names must be unique (the model calls them by name), got {names}")
    return tools


def tool_schema(fn: Callable, spec: str | None = None) -> dict:
    """The JSON schema the chat template shows the model (transformers' `get_json_schema`)."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # DocstringParsingException, TypeHintParsingException
        raise ToolError(
            f"tool {spec or fn.__name__!r} cannot be described to the model: {e}. A tool needs type hints on every "
            "parameter and a docstring with an `Args:` section describing each one"
        ) from None


def check_template(tokenizer, template_kwargs: dict | None = None) -> None:
    """Raise a ToolError unless the tokenizer's chat template renders a whole tool exchange (the call's name and
    arguments and the tool's answer all appear) and renders an assistant turn identically with and without the tool
    answer after it (what `tool_suffix_ids` relies on)."""
    kwargs = dict(template_kwargs or {})
    if not getattr(tokenizer, "chat_template", None):
        raise ToolError("tools need a chat template that renders tool calls; the tokenizer has none")
    call = [{"type": "function", "function": {"name": "tool_name_x7", "arguments": {"arg_key_x7": "arg_val_x7"}}}]
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": call},
        {"role": "tool", "name": "tool_name_x7", "content": "tool_answer_x7"},
    ]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except Exception as e:
        raise ToolError(
            f"the chat template cannot render a tool call and its answer ({type(e).__name__}: {e})"
        ) from None
    parts = {
        "tool_name_x7": "the call's name",
        "arg_key_x7": "its arguments",
        "arg_val_x7": "their values",
        "tool_answer_x7": "the tool's answer",
    }
    missing = [what for sentinel, what in parts.items() if sentinel not in text]
    if missing:
        raise ToolError(
            f"the chat template drops part of a tool exchange (it does not render {', '.join(missing)}): use a "
            "template made for tool calling (e.g. Qwen2.5/Qwen3's), set with `model.chat_template`"
        )
    tool_suffix_ids(tokenizer, [messages[2]], kwargs)


def tool_suffix_ids(tokenizer, tool_messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
    """The ids the chat template writes after an assistant turn's end-of-turn for `tool_messages`, through the next
    assistant header: rendered after a minimal call and cut where the call's turn ends (its last EOS; some
    templates write a newline after it), as TRL's `_get_tool_suffix_ids`."""
    kwargs = dict(template_kwargs or {})
    call = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
    head = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": call}]
    prefix = _ids(tokenizer.apply_chat_template(head, tokenize=True, add_generation_prompt=False, **kwargs))
    full = _ids(
        tokenizer.apply_chat_template(head + tool_messages, tokenize=True, add_generation_prompt=True, **kwargs)
    )
    ends = [i for i, t in enumerate(prefix) if t == tokenizer.eos_token_id]
    if ends:
        prefix = prefix[: ends[-1] + 1]
    if full[: len(prefix)] != prefix:
        raise ToolError(
            "the chat template renders an assistant turn with a tool call differently when the tool's answer follows "
            "it, so the answer cannot be appended to sampled tokens; use a template that renders earlier turns the "
            "same whatever follows (Qwen2.5/Qwen3's do)"
        )
    return full[len(prefix) :]


def _ids(rendered) -> list[int]:
    """apply_chat_template's ids, whether it returned a list or a BatchEncoding."""
    return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class ToolCallParser:
    """An assistant turn's ids → `{"role": "assistant", "content": str, "tool_calls": [...]}` (no `tool_calls` key
    without a call). `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes, Qwen2.5,
    Qwen3 and most tool-tuned open models); `tokenizer`: the tokenizer's own `parse_response` (a response schema or
    template set on it); `auto`: the tokenizer's where it has one, else hermes. A call that does not parse makes the
    turn plain text, as TRL's `parse_response` falls back."""

    def __init__(self, tokenizer, fmt: ToolCallFormat = "auto"):
        self.tok = tokenizer
        own = getattr(tokenizer, "response_template", None) or getattr(tokenizer, "response_schema", None)
        if fmt == "tokenizer" and not own:
            raise ToolError(
                "tool_call_format: tokenizer needs a tokenizer with a response schema or template (transformers' "
                "`parse_response`); this one has none: use tool_call_format: hermes, or set one on the tokenizer"
            )
        self.fmt = "tokenizer" if fmt == "tokenizer" or (fmt == "auto" and own) else "hermes"

    def __call__(self, ids: list[int], prefix: list[int] | None = None) -> dict:
        """`prefix`: the ids before the turn (what a tokenizer's response template reads for text the chat template
        pre-wrote, such as an opening `<think>`)."""
        if self.fmt == "tokenizer":
            return self._own(ids, prefix)
        text = self.tok.decode(ids, skip_special_tokens=False)
        for special in (self.tok.eos_token, self.tok.pad_token):
            if special:
                text = text.replace(special, "")
        calls = []
        for block in _HERMES.findall(text):
            call = _function_call(block)
            if call is None:  # a malformed call: the whole turn is text
                return {"role": "assistant", "content": self.tok.decode(ids, skip_special_tokens=True)}
            calls.append(call)
        message: dict[str, Any] = {"role": "assistant", "content": _HERMES.sub("", text).strip()}
        if calls:
            message["tool_calls"] = calls
        return message

    def _own(self, ids: list[int], prefix: list[int] | None) -> dict:
        try:
            if getattr(self.tok, "response_template", None) is not None:  # transformers' new-style parser
                parsed = self.tok.parse_response(ids, prefix=prefix or [])
            else:
                parsed = self.tok.parse_response(ids)
            if parsed is None:
                raise ValueError("nothing parsed")
            parsed = dict(parsed)
            content = parsed.get("content") or ""
            if isinstance(content, str) and self.tok.eos_token:
                content = content.removesuffix(self.tok.eos_token)
            parsed["content"] = content
            calls = [c for c in parsed.get("tool_calls") or [] if _well_formed(c)]
            if len(calls) != len(parsed.get("tool_calls") or []):
                raise ValueError("a malformed call")
            parsed.pop("tool_calls", None)
            return {**parsed, "role": "assistant", **({"tool_calls": calls} if calls else {})}
        except (ValueError, TypeError, KeyError):
            return {"role": "assistant", "content": self.tok.decode(ids, skip_special_tokens=True)}


def _function_call(block: str) -> dict | None:
    try:
        obj = json.loads(block)
        name, arguments = obj["name"], obj.get("arguments", obj.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            arguments = json.loads(arguments)
    except (ValueError, KeyError, TypeError):
        return None
    call = {"type": "function", "function": {"name": name, "arguments": arguments}}
    return call if _well_formed(call) else None


def _well_formed(call: Any) -> bool:
    fn = call.get("function") if isinstance(call, dict) else None
    return isinstance(fn, dict) and isinstance(fn.get("name"), str) and isinstance(fn.get("arguments"), dict)


def run_calls(calls: list[dict], tools: dict[str, Callable]) -> tuple[list[dict], int]:
    """Run one turn's calls → (the tool messages in call order, failures). Async tools of the turn run concurrently.
    A failure (unknown tool, bad arguments, an exception) answers `{"error": "..."}`, as TRL's."""
    results: list[Any] = [None] * len(calls)
    failed = [False] * len(calls)
    pending = []
    for i, call in enumerate(calls):
        name, args = call["function"]["name"], call["function"]["arguments"]
        fn = tools.get(name)
        try:
            if fn is None:
                raise ValueError(f"Tool {name} not found.")
            if inspect.iscoroutinefunction(fn):
                pending.append((i, fn(**args)))
            else:
                results[i] = fn(**args)
        except Exception as e:
            results[i], failed[i] = {"error": str(e)}, True
    if pending:

        async def gather():
            return await asyncio.gather(*(c for _, c in pending), return_exceptions=True)

        for (i, _), value in zip(pending, _run_coroutine(gather), strict=True):
            if isinstance(value, Exception):
                results[i], failed[i] = {"error": str(value)}, True
            else:
                results[i] = value
    messages = [
        {"role": "tool", "name": call["function"]["name"], "content": str(result)}
        for call, result in zip(calls, results, strict=True)
    ]
    return messages, sum(failed)


def _run_coroutine(make: Callable[[], Any]) -> Any:
    """Run the coroutine `make()` returns to completion: here, or on a thread of its own where this thread already
    runs an event loop (a caller in async code)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make())
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: asyncio.run(make())).result()


@dataclass
class ToolRollout:
    """The completions of a rollout after their tool turns (lists per completion, in the engine's order)."""

    completion_ids: list[list[int]]
    """Every turn's sampled tokens and the tool answers between them, as one completion."""
    tool_mask: list[list[int]]
    """1 on sampled tokens, 0 on tool answers (and the template's turn headers around them)."""
    logprobs: list[list[float]] | None
    """The engine's sampling log-probs (0 on tool answers), when asked for."""
    ended: list[bool]
    """Whether the last turn ended with EOS."""
    messages: list[list[dict]]
    """The conversation after the prompt: assistant turns (with `tool_calls`) and tool messages."""
    calls: int = 0
    failures: int = 0
    answers: list[str] = field(init=False)
    """Each completion's last assistant turn's text: what it finally answered (reward functions' `completions`)."""

    def __post_init__(self) -> None:
        self.answers = [
            next((m["content"] for m in reversed(ms) if m["role"] == "assistant"), "") for ms in self.messages
        ]


def tool_turns(
    engine,
    prompts: list[list[int]],
    gens: list,
    sampling,
    tools: list[Callable],
    parser: ToolCallParser,
    max_completion_length: int,
    max_iterations: int | None = None,
    window: int | None = None,
    seed: int | None = None,
    logprobs: bool = False,
    template_kwargs: dict | None = None,
) -> ToolRollout:
    """Run the tool turns of a rollout. `prompts[i]`: the ids completion i was sampled from (its prompt repeated per
    sample); `gens`: the engine's first turns (`Generation`s). Continuations sample with `sampling` up to the room
    each completion has left (`max_completion_length` in all, and `window` positions with the prompt)."""
    by_name = {t.__name__: t for t in tools}
    ids = [list(g.completion_ids) for g in gens]
    mask = [[1] * len(x) for x in ids]
    logps = [list(g.logprobs) for g in gens] if logprobs else None
    ended = [g.finish_reason == "stop" for g in gens]
    first = [
        parser(x, p) if e else {"role": "assistant", "content": g.completion}
        for x, e, g, p in zip(ids, ended, gens, prompts, strict=True)
    ]
    messages = [[m] for m in first]
    calling = [i for i, m in enumerate(first) if m.get("tool_calls")]
    calls = failures = 0
    iteration = 0
    while calling and (max_iterations is None or iteration < max_iterations):
        contexts, suffixes, answers = [], [], []
        for i in calling:
            answer, failed = run_calls(messages[i][-1]["tool_calls"], by_name)
            calls, failures = calls + len(messages[i][-1]["tool_calls"]), failures + failed
            suffix = tool_suffix_ids(parser.tok, answer, template_kwargs)
            fits = len(ids[i]) + len(suffix) <= max_completion_length
            if fits and (window is None or len(prompts[i]) + len(ids[i]) + len(suffix) < window):
                contexts.append(i)
                suffixes.append(suffix)
                answers.append(answer)
        if not contexts:
            break
        left = [max_completion_length - len(ids[i]) - len(s) for i, s in zip(contexts, suffixes)]
        step = sampling.model_copy(update={"max_new_tokens": max(max(left), 1)})
        extra = {"logprobs": True} if logprobs else {}
        turn_seed = None if seed is None else seed + 100_003 * (iteration + 1)
        inputs = [prompts[i] + ids[i] + s for i, s in zip(contexts, suffixes)]
        more = engine.generate(inputs, 1, step, seed=turn_seed, **extra)
        calling = []
        for i, context, suffix, answer, room, gen in zip(contexts, inputs, suffixes, answers, left, more, strict=True):
            new = list(gen.completion_ids)[: max(room, 0)]
            stopped = gen.finish_reason == "stop" and len(new) == len(gen.completion_ids)
            ids[i] += suffix + new
            mask[i] += [0] * len(suffix) + [1] * len(new)
            if logps is not None:
                logps[i] += [0.0] * len(suffix) + list(gen.logprobs or [])[: len(new)]
            ended[i] = stopped
            reply = (
                parser(new, context)
                if stopped
                else {"role": "assistant", "content": parser.tok.decode(new, skip_special_tokens=True)}
            )
            messages[i] += answer + ([reply] if new else [])
            if new and reply.get("tool_calls"):
                calling.append(i)
        iteration += 1
    return ToolRollout(ids, mask, logps, ended, messages, calls, failures)


@dataclass
class ToolRunner:
    """A run's tools and how its rollouts call them (what `grpo.sample` holds)."""

    functions: list[Callable]
    parser: ToolCallParser
    max_completion_length: int
    max_iterations: int | None = None
    window: int | None = None
    """The model's positions (its config's `max_position_embeddings`): a tool result must leave room for a token."""
    template_kwargs: dict = field(default_factory=dict)

    @classmethod
    def for_model(
        cls,
        tools: list[Callable],
        tokenizer,
        model,
        fmt: ToolCallFormat,
        max_completion_length: int,
        max_iterations: int | None = None,
        template_kwargs: dict | None = None,
    ) -> ToolRunner:
        """The runner of a model's rollouts, after checking that its chat template can carry tool turns."""
        check_template(tokenizer, template_kwargs)
        window = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        return cls(
            list(tools),
            ToolCallParser(tokenizer, fmt),
            max_completion_length,
            max_iterations,
            window if isinstance(window, int) else None,
            dict(template_kwargs or {}),
        )

    def turns(self, engine, prompts: list[list[int]], gens: list, sampling, seed: int | None, logprobs: bool):
        return tool_turns(
            engine, prompts, gens, sampling, self.functions, self.parser, self.max_completion_length,
            self.max_iterations, self.window, seed, logprobs, self.template_kwargs,
        )  # fmt: skip
