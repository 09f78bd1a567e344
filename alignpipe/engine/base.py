"""The generation interface every backend meets (`hf` here, `vllm` in `vllm.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from alignpipe.engine.sampling import SamplingParams

FinishReason = Literal["stop", "length"]


@dataclass
class Generation:
    """One completion. `completion_ids` ends with EOS when `finish_reason == "stop"`."""

    prompt_index: int
    completion: str
    completion_ids: list[int]
    finish_reason: FinishReason
    logprobs: list[float] | None = None
    """When asked for (`generate(..., logprobs=True)`): each completion token's log-probability under the
    distribution it was sampled from (after temperature, penalties and filters: vLLM's "processed" logprobs); NaN
    where the engine could not say (a token it did not sample, e.g. an EOS appended after a stop string)."""


class GenerationEngine(Protocol):
    def generate(
        self,
        prompts: list[str],
        n: int = 1,
        sampling: SamplingParams | None = None,
        seed: int | None = None,
        logprobs: bool = False,
    ) -> list[Generation]:
        """`n` completions per prompt, grouped by prompt: result[i * n + j] is prompt i's j-th; with `logprobs`,
        each with its sampling log-probs (`Generation.logprobs`)."""
        ...
