"""A published model as an MLflow pyfunc model, so a registered version loads the way MLflow users load models:
`mlflow.pyfunc.load_model("models:/<name>@<alias>").predict(["prompt", ...])` returns one completion per prompt.

The pyfunc folder holds `MLmodel`, the signature (strings in, one column or a list; a string out; `max_new_tokens`,
`temperature`, `top_p` and `seed` as params) and the model folder itself (weights, tokenizer, model card) as its
`model` artifact, and an input example; a LoRA adapter is merged first, so the version stands alone. Loading needs
alignpipe installed (listed in the model's requirements): MLflow runs `pyfunc_model.py` ("models from code"), which
builds the model from the class here; nothing is unpickled. MLflow's own transformers flavor is
not used: with MLflow 3.17 and transformers 5 saving a local folder fails, and loading imports torchvision.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
from mlflow.pyfunc import PythonModel

DEFAULTS: dict[str, Any] = {"max_new_tokens": 64, "temperature": 0.0, "top_p": 1.0, "seed": 0}
INPUT_EXAMPLE = ["Write one sentence about the sea."]
"""Saved with the model (MLflow's UI shows it, `mlflow models serve` users copy it); saving it runs nothing."""


class TextGenerator(PythonModel):
    """Completions for prompts with the published causal LM (alignpipe's `hf` engine: batched, KV-cached)."""

    def load_context(self, context) -> None:
        from alignpipe.engine.hf import HFEngine
        from alignpipe.modeling import load_causal_lm, load_tokenizer

        folder = context.artifacts["model"]
        self.engine = HFEngine(load_causal_lm(folder), load_tokenizer(folder))

    def predict(self, context, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> list[str]:
        """One completion per prompt. `model_input` is what pyfunc hands over after enforcing the signature (a
        DataFrame); a list of strings or one string is taken too (`prompts_of`). The type hint tells MLflow to
        validate nothing beyond the signature."""
        from alignpipe.engine.sampling import SamplingParams

        prompts = prompts_of(model_input)
        p = {**DEFAULTS, **(params or {})}
        sampling = SamplingParams(max_new_tokens=p["max_new_tokens"], temperature=p["temperature"], top_p=p["top_p"])
        return [g.completion for g in self.engine.generate(prompts, sampling=sampling, seed=int(p["seed"]))]


def prompts_of(model_input) -> list[str]:
    """A pandas DataFrame (its `prompt` column, else its first; what pyfunc passes after schema enforcement), a list
    of strings, or one string."""
    if isinstance(model_input, str):
        return [model_input]
    if hasattr(model_input, "columns"):
        column = "prompt" if "prompt" in model_input.columns else model_input.columns[0]
        return [str(x) for x in model_input[column].tolist()]
    return [str(x) for x in model_input]


def signature():
    from mlflow.models import ModelSignature
    from mlflow.types.schema import ColSpec, ParamSchema, ParamSpec, Schema

    return ModelSignature(
        inputs=Schema([ColSpec("string")]),  # unnamed: a list of strings or a one-column DataFrame
        outputs=Schema([ColSpec("string")]),
        params=ParamSchema(
            [
                ParamSpec("max_new_tokens", "long", DEFAULTS["max_new_tokens"]),
                ParamSpec("temperature", "double", DEFAULTS["temperature"]),
                ParamSpec("top_p", "double", DEFAULTS["top_p"]),
                ParamSpec("seed", "long", DEFAULTS["seed"]),
            ]
        ),
    )


def requirements() -> list[str]:
    from importlib.metadata import version

    return [f"{name}=={version(name)}" for name in ("alignpipe", "torch", "transformers", "tokenizers", "mlflow")]


def save_pyfunc(model_folder: Path, dest: Path) -> Path:
    """Write the pyfunc model at `dest` (replaced if present) around the full model at `model_folder`."""
    import shutil

    import mlflow.pyfunc

    if dest.exists():
        shutil.rmtree(dest)
    mlflow.pyfunc.save_model(
        path=str(dest),
        python_model=str(Path(__file__).with_name("pyfunc_model.py")),  # built by code at load time, no pickle
        artifacts={"model": str(model_folder)},
        signature=signature(),
        input_example=INPUT_EXAMPLE,
        pip_requirements=requirements(),
        metadata={"task": "text-generation", "alignpipe": True},
    )
    return dest
