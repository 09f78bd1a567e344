"""Recipe sections other than stages: the model, datasets, tracking and stage resources."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from alignpipe.strict import Strict


class ModelSpec(Strict):
    """The starting model every stage refers to as `base`."""

    path: str
    """Local directory or Hugging Face Hub id (e.g. `Qwen/Qwen2.5-0.5B-Instruct`)."""
    tokenizer: str | None = None
    """Tokenizer directory or Hub id; null uses `path`."""
    eos_token: str | None = None
    """Override the tokenizer's EOS with this token (one token of its vocabulary), e.g. `<|im_end|>` when a base model
    learns a chat template whose turns end there: what the trainers append, where generation stops, and what every
    saved tokenizer and model (its generation config) says. Null keeps the tokenizer's."""
    chat_template: str | None = None
    """A Jinja chat template replacing the tokenizer's, inline or as the path of a `.jinja` file (read when the
    recipe loads, so the recipe's fingerprint covers it). Saved with every trained tokenizer. For
    `assistant_only_loss` with a template that renders a conversation differently in part and in whole (Qwen3 and
    DeepSeek-R1 drop earlier turns' reasoning), give a training version of it that wraps each assistant reply in
    `{% generation %}` … `{% endgeneration %}`: the replies are then read from those marks. Null keeps the
    tokenizer's."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) to load; ignored for local paths."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    """Weights dtype for training and generation. bf16 needs a GPU that supports it."""
    trust_remote_code: bool = False
    """Allow the model repo's own Python code to run. Off unless you trust the repo."""
    attention: Literal[
        "auto", "sdpa", "varlen", "eager", "flash_attention_2", "flash_attention_3", "flex_attention"
    ] = "auto"
    """The attention kernels every stage's models run (transformers' `attn_implementation`). `auto`: `varlen` where
    it pays and is known exact (a CUDA device, bf16/fp16 weights, a Llama, Qwen2, Qwen3 or Mistral model without
    sliding-window layers or attention dropout), `sdpa` elsewhere (CPU, float32, other models); the log says which
    and why. `sdpa`: PyTorch's scaled-dot-product attention, on CPU and GPU; packed SFT rows get a block-diagonal
    mask, which keeps SDPA off its flash kernel and computes the whole T × T square. `varlen`: packed SFT rows run as
    variable-length sequences through the flash kernel that ships inside PyTorch (a CUDA GPU, bf16/fp16; nothing to
    install), no mask and no work outside each row; unpacked SFT batches, DPO, KTO, reward and online batches and
    PPO's episodes run padding-free the same way, as one row of documents with each prompt run once
    (`alignpipe/packed_rows.py`); everything else (decoding, generation's prefill) runs as `sdpa`
    (`alignpipe/attention.py`). Its first call of
    each kind is checked against SDPA run document by document. On CPU or in float32 the rows run one by one (exact,
    slower). `flash_attention_2`/`_3` (a CUDA GPU and the `flash-attn` package): packed and padding-free rows run as
    variable-length sequences, no mask and no work on the masked-out blocks. `flex_attention`: FlexAttention block
    masks (GPU; its backward does not run on CPU). `eager`: plain matmuls, for debugging."""

    @field_validator("chat_template")
    @classmethod
    def _template_text(cls, value: str | None) -> str | None:
        if value is None or "{{" in value or "{%" in value:
            return value
        path = Path(value).expanduser()
        if not path.is_file():
            raise ValueError(
                f"chat_template {value!r} is neither a Jinja template (no {{{{ or {{% in it) nor a file; give the "
                "template itself or the path of a .jinja file"
            )
        return path.read_text()


class DatasetSpec(Strict):
    """A raw dataset; `format` stages turn it into a canonical training format."""

    path: str
    """A local file (.jsonl/.json/.csv/.parquet), a directory saved by `datasets`, or a Hub dataset id."""
    type: Literal["auto", "json", "csv", "parquet", "arrow", "hub"] = "auto"
    """How to read `path`; auto decides by extension, directory or Hub id."""
    split: str = "train"
    """Split to read (Hub datasets and saved DatasetDicts)."""
    subset: str | None = None
    """Hub dataset configuration name, if it has several."""
    revision: str | None = None
    """Hub dataset revision."""
    columns: dict[str, str] = Field(default_factory=dict)
    """Canonical column → column in this dataset, e.g. `{prompt: question, completion: answer}`.
    Canonical names: text, messages, prompt, completion, chosen, rejected, answer."""


class Tracking(Strict):
    """Where MLflow records runs."""

    uri: str | None = Field(None, json_schema_extra={"may_hold_a_secret": True})
    """MLflow tracking URI; null means a SQLite store at `<workdir>/mlflow.db`. A `http(s)://` URI uses
    a running `mlflow server`; credentials come from where MLflow's client reads them (MLFLOW_TRACKING_USERNAME and
    MLFLOW_TRACKING_PASSWORD, or MLFLOW_TRACKING_TOKEN, or `~/.mlflow/credentials`), never from the recipe: a URI
    with credentials in it (`user:password@`) is refused."""
    experiment: str | None = None
    """MLflow experiment name; null uses the recipe name."""
    system_metrics_every: float | None = Field(10.0, gt=0)
    """Seconds between samples of the machine a stage runs on, logged to the stage's run as `system/…` metrics by
    MLflow's monitor: each NVIDIA GPU's utilisation, memory and power (through nvidia-ml-py), CPU, memory, disk and
    network. A GPU idle between rollouts or waiting on the host shows there beside the training curves. Null logs
    none."""

    @field_validator("uri")
    @classmethod
    def _no_password(cls, value: str | None) -> str | None:
        if value and re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://[^/?#]*@", value):
            raise ValueError(
                "the tracking URI holds credentials (`user:password@` or `token@`); a recipe is shared and logged, so "
                "remove them from the URI and set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or "
                "MLFLOW_TRACKING_TOKEN) in the environment"
            )
        return value


class Storage(Strict):
    """A storage root every worker reaches, for pools on several machines (see infra/README.md)."""

    url: str = Field(pattern=r"^[A-Za-z][A-Za-z0-9+.-]*://.+")
    """fsspec URL of the root, e.g. `s3://bucket/alignpipe`, `gs://bucket/prefix`, `file:///mnt/shared`.
    Stage folders are mirrored under `<url>/<recipe name>/`; `workdir` becomes each machine's working
    copy. Credentials come from the environment the way the filesystem's library reads them
    (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, GOOGLE_APPLICATION_CREDENTIALS...), never from the recipe."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Non-secret filesystem options passed to fsspec, e.g. `{endpoint_url: "http://minio:9000"}` for s3."""

    @field_validator("options")
    @classmethod
    def _no_secrets(cls, value: dict[str, Any]) -> dict[str, Any]:
        secret = sorted(secret_option_names(value))
        if secret:
            raise ValueError(
                f"storage option(s) {secret} look like credentials; a recipe is shared and logged, so "
                "put credentials in the environment (e.g. AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)"
            )
        return value


_SECRET_WORDS = {"secret", "token", "password", "passwd", "credential", "credentials", "sas"}
_KEY_QUALIFIERS = {"access", "account", "private", "api", "secret", "signing", "master"}


def secret_option_names(options: dict[str, Any], prefix: str = "") -> list[str]:
    """Option names (nested dicts too, as `client_kwargs.aws_secret_access_key`) that name a credential: a word
    like secret/token/password, a bare `key`, or a `…access_key`-style name. `sse_kms_key_id` or `key_prefix`
    name no secret and pass."""
    found = []
    for name, v in options.items():
        words = [w for w in re.split(r"[^a-z0-9]+", str(name).lower()) if w]
        qualified = len(words) >= 2 and words[-1] == "key" and words[-2] in _KEY_QUALIFIERS
        if _SECRET_WORDS & set(words) or words == ["key"] or qualified:
            found.append(prefix + str(name))
        elif isinstance(v, dict):
            found += secret_option_names(v, f"{prefix}{name}.")
    return found


class Resources(Strict):
    """Where and how a stage runs."""

    pool: str | None = None
    """Prefect work pool to dispatch this stage to; null runs it in a child process beside the flow."""
    processes: int = Field(1, gt=0)
    """Processes (`accelerate launch`) for data-parallel training."""
    strategy: Literal["ddp", "fsdp"] = "ddp"
    """How `processes` > 1 share the model: `ddp` (each a full copy, gradients all-reduced) or `fsdp` (FSDP2:
    parameters, gradients and optimizer state sharded across processes, for models that do not fit one device;
    checkpoints are sharded, the saved model is a normal transformers folder). An `accelerate_config` with its own
    FSDP settings takes precedence over the defaults this sets."""
    accelerate_config: str | None = None
    """An accelerate config file (FSDP, DeepSpeed) for `accelerate launch --config_file`."""
    gpus: int = Field(0, ge=0)
    """GPUs the stage needs: where it runs (locally or on a pool's worker) the stage fails at once, before loading
    anything, if fewer CUDA devices are visible."""
    retries: int = Field(0, ge=0)
    """Prefect task retries for this stage (a retry resumes from the last checkpoint)."""
    timeout_s: int | None = Field(None, gt=0)
    """Kill the stage after this many seconds of wall time, whether or not it is printing (a silent hang too); the
    stage fails with an error naming the timeout, and `retries` then resumes it from its last checkpoint."""
    tags: list[str] = Field(default_factory=list)
    """Prefect tags for the stage's task run, besides `alignpipe` and its kind (both always there): runs are found by
    them in Prefect's UI, and a tag concurrency limit caps how many tagged stages run at once across every pipeline
    on the server (`prefect concurrency-limit create llm-judge 2`: at most two stages tagged `llm-judge` at a time,
    the others wait). Not part of the stage's cache key."""

    @field_validator("tags")
    @classmethod
    def _words(cls, value: list[str]) -> list[str]:
        bad = [t for t in value if not t or t != t.strip()]
        if bad:
            raise ValueError(f"a tag is a non-empty string without surrounding spaces (got {bad})")
        return value
