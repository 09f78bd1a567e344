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


class GenerationEngine(Protocol):
    def generate(
        self, prompts: list[str], n: int = 1, sampling: SamplingParams | None = None, seed: int | None = None
    ) -> list[Generation]:
        """`n` completions per prompt, grouped by prompt: result[i * n + j] is prompt i's j-th."""
        ...
