"""Sampling settings shared by every generation backend (torch-free, used in recipes)."""

from pydantic import Field

from alignpipe.strict import Strict


class SamplingParams(Strict):
    """How to sample completions."""

    max_new_tokens: int = Field(48, gt=0)
    """Most tokens to generate per completion."""
    temperature: float = Field(1.0, ge=0)
    """Softmax temperature; 0 means greedy decoding."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling: keep the smallest token set with this much probability."""
    top_k: int = Field(0, ge=0)
    """Keep only the k most likely tokens; 0 disables."""
    min_p: float = Field(0.0, ge=0, lt=1)
    """Drop tokens whose probability is below min_p × the top token's."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
