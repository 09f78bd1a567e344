"""Reward functions: built-ins by name, or any `module:function` callable.

A reward function takes `(prompts, completions, **columns)` (lists of equal length; `columns` are the
dataset's extra columns, e.g. `answer`) and returns one float (or None = not applicable) per completion.
"""

from __future__ import annotations

import importlib
import re
from typing import Callable

from alignpipe.data.synthetic import sentiment_score

RewardFn = Callable[..., list]


def sentiment_lexicon(prompts, completions, **_) -> list[float]:
    """Weighted positive minus negative words (the synthetic sentiment task's lexicon)."""
    return [sentiment_score(c) for c in completions]


def length(prompts, completions, **_) -> list[float]:
    """Number of words in the completion."""
    return [float(len(c.split())) for c in completions]


def exact_match(prompts, completions, answer=None, **_) -> list[float | None]:
    """1.0 when the completion's first number/word equals the `answer` column, else 0.0."""
    if answer is None:
        return [None] * len(completions)
    out = []
    for c, a in zip(completions, answer):
        found = re.findall(r"-?\d+(?:\.\d+)?|\S+", c.strip())
        out.append(1.0 if found and found[0] == str(a).strip() else 0.0)
    return out


BUILTINS: dict[str, RewardFn] = {"sentiment_lexicon": sentiment_lexicon, "length": length, "exact_match": exact_match}


class RewardFunctionError(ValueError):
    pass


def load_reward_fn(spec: str) -> RewardFn:
    """A built-in name or `package.module:function`; raises RewardFunctionError naming the problem."""
    if spec in BUILTINS:
        return BUILTINS[spec]
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise RewardFunctionError(f"reward {spec!r} is neither a built-in ({', '.join(BUILTINS)}) nor `module:function`")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise RewardFunctionError(f"reward {spec!r}: cannot import module {module_name!r}: {e}") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RewardFunctionError(f"reward {spec!r}: module {module_name!r} has no callable {attr!r}")
    return fn


def score(fn: RewardFn, name: str, prompts: list[str], completions: list[str], columns: dict[str, list] | None = None) -> list[float | None]:
    """Call `fn` and check it returned one number (or None) per completion."""
    result = list(fn(prompts, completions, **(columns or {})))
    if len(result) != len(completions):
        raise RewardFunctionError(f"reward {name!r} returned {len(result)} values for {len(completions)} completions")
    for v in result:
        if v is not None and not isinstance(v, (int, float)):
            raise RewardFunctionError(f"reward {name!r} returned {type(v).__name__}; expected float or None")
    return [None if v is None else float(v) for v in result]
