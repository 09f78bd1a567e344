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
    repetition_penalty: float = Field(1.0, gt=0)
    """Above 1, discourage tokens already in the prompt or the completion so far: a seen token's logit is divided by
    it when positive and multiplied by it otherwise (the rule of transformers and vLLM; prompt padding is not
    counted); 1 disables. In RL it shapes sampling only: the trained log-probs are the policy's own, as in TRL."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
