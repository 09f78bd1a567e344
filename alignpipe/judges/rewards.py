"""Reward functions: built-ins by name, or any `module:function` callable.

A reward function takes `(prompts, completions, **columns)` (lists of equal length; `columns` are the
dataset's extra columns, e.g. `answer`) and returns one float (or None = not applicable) per completion. A function
with a parameter named `completion_ids` also gets each completion's token ids (in RL stages, where they exist), as
TRL's reward functions do; one named `completion_messages` gets each completion's turns (with tools: the assistant
turns and tool results; otherwise one assistant turn).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from typing import Any

from pydantic import Field, ValidationError, field_validator, model_validator

from alignpipe.data.synthetic import sentiment_score
from alignpipe.judges.http_endpoints import auth_headers, json_with_retries
from alignpipe.judges.math_answer import math_answer
from alignpipe.strict import Strict
from alignpipe.user_code import check_callable_name, import_callable

RewardFn = Callable[..., list]


def sentiment_lexicon(prompts, completions, **_) -> list[float]:
    """Weighted positive minus negative words (the synthetic sentiment task's lexicon)."""
    return [sentiment_score(c) for c in completions]


def length(prompts, completions, **_) -> list[float]:
    """Number of words in the completion."""
    return [float(len(c.split())) for c in completions]


def exact_match(prompts, completions, answer=None, **_) -> list[float | None]:
    """1.0 when the completion, whitespace-normalised, equals the `answer` column, else 0.0."""
    if answer is None:
        return [None] * len(completions)
    return [1.0 if " ".join(c.split()) == " ".join(str(a).split()) else 0.0 for c, a in zip(completions, answer)]


def keyword(prompts, completions, words=(), case_sensitive=False, **_) -> list[float]:
    """Number of occurrences of any of `words` (kwargs) in the completion."""
    out = []
    for c in completions:
        text = c if case_sensitive else c.lower()
        out.append(float(sum(text.count(w if case_sensitive else w.lower()) for w in words)))
    return out


def regex(prompts, completions, pattern="", **_) -> list[float]:
    """1.0 when `pattern` (kwargs) matches anywhere in the completion, else 0.0."""
    compiled = re.compile(pattern)
    return [1.0 if compiled.search(c) else 0.0 for c in completions]


def length_penalty(prompts, completions, target=20, scale=0.05, **_) -> list[float]:
    """−scale × |words − target|: prefers completions of about `target` words."""
    return [-scale * abs(len(c.split()) - target) for c in completions]


THINK_FORMAT = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL | re.MULTILINE)


def think_format(prompts, completions, **_) -> list[float]:
    """1.0 when the completion opens with its reasoning in one `<think>` … `</think>` block (DeepSeek-R1's format;
    TRL's `think_format_reward`), else 0.0."""
    return [1.0 if THINK_FORMAT.match(c) else 0.0 for c in completions]


def _needs_ids(name: str, completion_ids) -> list[list[int]]:
    if completion_ids is None:
        raise RewardFunctionError(
            f"reward {name!r} counts the completion's tokens, and this stage scores text alone: use it in an RL stage "
            "(grpo, rloo, ppo, online_dpo)"
        )
    return completion_ids


def ngram_repetition(prompts, completions, completion_ids=None, ngram_size=3, max_penalty=-1.0, **_) -> list[float]:
    """(1 − unique n-grams / n-grams of the completion's tokens) × `max_penalty` (≤ 0): 0 for no repeated n-gram,
    towards `max_penalty` for a degenerate loop ("Demystifying Long Chain-of-Thought Reasoning", App. C.2; TRL's
    `get_repetition_penalty_reward`); 0 for completions shorter than `ngram_size` tokens."""
    out = []
    for ids in _needs_ids("ngram_repetition", completion_ids):
        if len(ids) < ngram_size:
            out.append(0.0)
            continue
        grams = list(zip(*[ids[i:] for i in range(ngram_size)], strict=False))
        repeated = 1 - len(set(grams)) / len(grams)
        out.append(repeated * max_penalty if repeated else 0.0)
    return out


def overlong_penalty(prompts, completions, completion_ids=None, max_length=256, cache=64, **_) -> list[float]:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13; TRL's `get_soft_overlong_punishment`): 0 up to
    `max_length − cache` tokens, then falling linearly to −1 at `max_length`, −1 beyond."""
    out = []
    for ids in _needs_ids("overlong_penalty", completion_ids):
        n = len(ids)
        if n <= max_length - cache:
            out.append(0.0)
        elif n <= max_length:
            out.append((max_length - cache - n) / cache)
        else:
            out.append(-1.0)
    return out


BUILTINS: dict[str, RewardFn] = {
    "sentiment_lexicon": sentiment_lexicon,
    "length": length,
    "exact_match": exact_match,
    "math_answer": math_answer,
    "keyword": keyword,
    "regex": regex,
    "length_penalty": length_penalty,
    "think_format": think_format,
    "ngram_repetition": ngram_repetition,
    "overlong_penalty": overlong_penalty,
}

TOKEN_REWARDS = frozenset({"ngram_repetition", "overlong_penalty"})
"""The built-ins that read the completions' token ids: RL stages only."""


class KeywordOptions(Strict):
    """`kwargs` of the `keyword` reward."""

    words: list[str] = Field(min_length=1)
    """Words or phrases whose occurrences are counted."""
    case_sensitive: bool = False
    """Match case exactly."""


class RegexOptions(Strict):
    """`kwargs` of the `regex` reward."""

    pattern: str = Field(min_length=1)
    """A Python regular expression searched for anywhere in the completion."""

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, v: str) -> str:
        try:
            re.compile(v)
        except re.error as e:
            raise ValueError(f"not a valid regular expression: {e}") from e
        return v


class LengthPenaltyOptions(Strict):
    """`kwargs` of the `length_penalty` reward."""

    target: float = Field(20, ge=0)
    """Preferred completion length in words."""
    scale: float = Field(0.05, gt=0)
    """Reward lost per word away from `target`."""


class MathAnswerOptions(Strict):
    """`kwargs` of the `math_answer` reward."""

    last_number_fallback: bool = True
    """When a completion marks no answer (`\\boxed{}`, `<answer>`, `####`, "the answer is"), take its last number;
    false pays only answers given in one of those forms."""


class NgramRepetitionOptions(Strict):
    """`kwargs` of the `ngram_repetition` reward."""

    ngram_size: int = Field(3, gt=0)
    """Length of the token n-grams compared."""
    max_penalty: float = Field(-1.0, le=0)
    """The reward of a wholly repetitive completion (≤ 0)."""


class OverlongPenaltyOptions(Strict):
    """`kwargs` of the `overlong_penalty` reward."""

    max_length: int = Field(256, gt=0)
    """L_max: the stage's `max_completion_length`, where the penalty reaches −1."""
    cache: int = Field(64, gt=0)
    """L_cache: how many tokens before `max_length` the penalty starts (DAPO: 4096 of 20480)."""

    @model_validator(mode="after")
    def _fits(self):
        if self.cache > self.max_length:
            raise ValueError(f"cache ({self.cache}) must not exceed max_length ({self.max_length})")
        return self


class NoOptions(Strict):
    """The built-in takes no `kwargs` (its inputs are the completions and dataset columns)."""


BUILTIN_OPTIONS: dict[str, type[Strict]] = {
    "sentiment_lexicon": NoOptions,
    "length": NoOptions,
    "exact_match": NoOptions,
    "math_answer": MathAnswerOptions,
    "keyword": KeywordOptions,
    "regex": RegexOptions,
    "length_penalty": LengthPenaltyOptions,
    "think_format": NoOptions,
    "ngram_repetition": NgramRepetitionOptions,
    "overlong_penalty": OverlongPenaltyOptions,
}
"""What each built-in's `kwargs` may hold. The built-ins take dataset columns as keyword arguments too, so a
misspelt option would otherwise be swallowed and the reward silently constant."""


def check_builtin_kwargs(name: str, kwargs: dict[str, Any]) -> None:
    """A ValueError naming what is wrong with `kwargs` for built-in `name`: an unknown option (with the option it
    resembles), a missing required one, or a value of the wrong kind."""
    options = BUILTIN_OPTIONS[name]
    try:
        options.model_validate(kwargs)
    except ValidationError as e:
        known = list(options.model_fields)
        takes = f"`{name}` takes kwargs {', '.join(known)}" if known else f"`{name}` takes no kwargs"
        problems = []
        for err in sorted(e.errors(), key=lambda err: err["type"] != "extra_forbidden"):  # misspellings first
            key = ".".join(str(part) for part in err["loc"])
            if err["type"] == "extra_forbidden":
                near = difflib.get_close_matches(key, known, n=1)
                problems.append(f"unknown option {key!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
            elif err["type"] == "missing":
                problems.append(f"{key!r} is required")
            else:
                problems.append(f"{key}: {err['msg'].removeprefix('Value error, ')} (got {err.get('input')!r})")
        raise ValueError(f"{'; '.join(problems)}; {takes}") from None


class RewardFunctionError(ValueError):
    pass


def check_reward_name(spec: str) -> str:
    """`spec` if it names a built-in or has the form `package.module:function`, else a ValueError saying what is
    wrong (a near built-in's name, if any). The module is not imported: it may exist only where the stage runs."""
    if spec in BUILTINS:
        return spec
    if ":" in spec:
        return check_callable_name(spec, "reward function")
    near = difflib.get_close_matches(spec, BUILTINS, n=1)
    guess = f"did you mean {near[0]!r}? " if near else ""
    raise ValueError(
        f"unknown reward function {spec!r}: {guess}the built-ins are {', '.join(BUILTINS)}; a function of your own "
        "is written `package.module:function`"
    )


def load_reward_fn(spec: str) -> RewardFn:
    """A built-in name or `package.module:function`; raises RewardFunctionError naming the problem."""
    if spec in BUILTINS:
        return BUILTINS[spec]
    try:
        return import_callable(spec, "reward")
    except ValueError as e:
        if ":" not in spec:
            raise RewardFunctionError(
                f"reward {spec!r} is neither a built-in ({', '.join(BUILTINS)}) nor `module:function`"
            ) from None
        raise RewardFunctionError(str(e)) from e.__cause__


class HTTPScorer:
    """A remote reward function: POST {"prompts", "completions", "columns"} → {"rewards": [float|null]}."""

    def __init__(self, url: str, timeout_s: float = 60.0, retries: int = 3, api_key: str | None = None):
        self.url, self.timeout_s, self.retries = url, timeout_s, retries
        self._headers = auth_headers(api_key)  # never in an error, a log or a repr

    def __call__(self, prompts, completions, **columns) -> list[float | None]:
        import httpx

        payload = {
            "prompts": list(prompts),
            "completions": list(completions),
            "columns": {k: list(v) for k, v in columns.items()},
        }
        answer = json_with_retries(
            lambda: httpx.post(self.url, json=payload, headers=self._headers, timeout=self.timeout_s),
            f"remote reward {self.url}",
            self.retries,
            self.timeout_s,
            RewardFunctionError,
        )
        return answer["rewards"]


def parameter_names(fn) -> set[str]:
    """The parameter names of `fn` (none for a callable without a signature)."""
    import inspect

    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        return set()


def score(
    fn: RewardFn,
    name: str,
    prompts: list[str],
    completions: list[str],
    columns: dict[str, list] | None = None,
    kwargs: dict | None = None,
    completion_ids: list[list[int]] | None = None,
    completion_messages: list[list[dict]] | None = None,
) -> list[float | None]:
    """Call `fn` and check it returned one number (or None) per completion. `completion_ids` and
    `completion_messages` go to a function with a parameter of that name."""
    named = parameter_names(fn)
    extra: dict[str, Any] = {"completion_ids": completion_ids} if "completion_ids" in named else {}
    if "completion_messages" in named:
        extra["completion_messages"] = completion_messages
    try:
        result = list(fn(prompts, completions, **(columns or {}), **(kwargs or {}), **extra))
    except RewardFunctionError:
        raise
    except Exception as e:
        raise RewardFunctionError(f"reward {name!r} raised {type(e).__name__}: {e}") from e
    if len(result) != len(completions):
        raise RewardFunctionError(f"reward {name!r} returned {len(result)} values for {len(completions)} completions")
    for v in result:
        if v is not None and not isinstance(v, (int, float)):
            raise RewardFunctionError(f"reward {name!r} returned {type(v).__name__}; expected float or None")
    return [None if v is None else float(v) for v in result]
