"""Several weighted reward functions used together in RL: total reward and per-function values."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from alignpipe.judges.http_endpoints import endpoint_api_key
from alignpipe.judges.rewards import HTTPScorer, RewardFunctionError, load_reward_fn, score


@dataclass
class LoadedReward:
    name: str
    fn: Callable
    weight: float = 1.0
    kwargs: dict = field(default_factory=dict)


class RewardSet:
    """Calls every function on a batch; `None` (not applicable) becomes NaN and is skipped in the
    weighted sum (TRL's nansum), and a row no function scored gets NaN in `total`."""

    def __init__(self, rewards: list[LoadedReward]):
        if not rewards:
            raise ValueError("at least one reward function is needed")
        self.rewards = rewards

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.rewards]

    def __call__(
        self,
        prompts: list[str],
        completions: list[str],
        columns: dict[str, list] | None = None,
        completion_ids: list[list[int]] | None = None,
        completion_messages: list[list[dict]] | None = None,
    ):
        """→ (total (N,), per_function (N, K)) float tensors. `completion_ids`: each completion's tokens;
        `completion_messages`: its turns (with tools; else one assistant turn, the completion); each for the functions
        that name them."""
        if completion_messages is None:
            completion_messages = [[{"role": "assistant", "content": c}] for c in completions]
        per = torch.full((len(completions), len(self.rewards)), math.nan)
        for k, r in enumerate(self.rewards):
            values = score(r.fn, r.name, prompts, completions, columns, r.kwargs, completion_ids, completion_messages)
            per[:, k] = torch.tensor([math.nan if v is None else v for v in values], dtype=torch.float)
            if torch.isinf(per[:, k]).any():
                raise RewardFunctionError(f"reward {r.name!r} returned inf")
        weights = torch.tensor([r.weight for r in self.rewards])
        total = (per * weights).nansum(1)
        total[torch.isnan(per).all(1)] = math.nan
        return total, per

    def probe(self, prompts: list[str], columns: dict[str, list] | None = None) -> None:
        """Call each function once on two rows before any rollout, so a broken one fails early, named."""
        n = min(2, len(prompts))
        cols = {k: v[:n] for k, v in (columns or {}).items()}
        self(prompts[:n], ["" for _ in range(n)], cols, [[] for _ in range(n)])


def load_rewards(specs, model_path_of: Callable[[str], str], batch_size: int = 32) -> RewardSet:
    """Build a RewardSet from recipe `RewardFunctionSpec`s; `model_path_of(stage_id)` locates reward models."""
    loaded = []
    for spec in specs:
        if spec.function:
            fn = load_reward_fn(spec.function)
        elif spec.reward_model:
            from alignpipe.judges.reward_model import RewardModelScorer

            fn = RewardModelScorer(model_path_of(spec.reward_model), batch_size)
        else:
            fn = HTTPScorer(
                spec.url, api_key=endpoint_api_key(spec.api_key_env, f"reward {spec.label!r}'s api_key_env")
            )
        loaded.append(LoadedReward(spec.label, fn, spec.weight, dict(spec.kwargs)))
    names = [r.name for r in loaded]
    if len(set(names)) != len(names):
        raise RewardFunctionError(f"reward names must be unique, got {names}; set `name:` on each")
    return RewardSet(loaded)
