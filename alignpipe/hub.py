"""Publishing: a model card generated from the run, and upload to the Hub or a local folder.

The Hub token is read by `huggingface_hub` from the environment (HF_TOKEN) only; it is never a
recipe field, a parameter or a logged value. HF_ENDPOINT is respected (e.g. a private Hub mirror).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

import yaml


@dataclass
class CardInfo:
    """Everything the model card says."""

    name: str
    base_model: str
    pipeline: str
    recipe_hash: str
    mlflow_run_id: str | None
    license: str = "apache-2.0"
    tags: list[str] = field(default_factory=list)
    datasets: list[dict] = field(default_factory=list)  # {name, path, fingerprint, rows}
    stages: list[dict] = field(default_factory=list)  # {id, kind, hyperparameters, metrics}
    win_rates: list[dict] = field(default_factory=list)  # {candidate, baseline, win_rate, ci_low, ci_high, n}
    adapter: bool = False
    description: str = ""


def without_front_matter(card: str) -> str:
    """The card for viewers that do not read Hub metadata (MLflow's artifact view shows a YAML header as raw text):
    the header becomes a small table under the title."""
    if not card.startswith("---\n"):
        return card
    header, body = card[4:].split("\n---\n", 1)
    meta = yaml.safe_load(header) or {}
    rows = ["| metadata | |", "|---|---|"] + [
        f"| {k} | {', '.join(map(str, v)) if isinstance(v, list) else v} |" for k, v in meta.items()
    ]
    lines = body.lstrip("\n").split("\n")
    title, rest = (lines[0], lines[1:]) if lines and lines[0].startswith("# ") else ("", lines)
    return "\n".join([title, "", *rows, *rest]).lstrip("\n")


def model_card(info: CardInfo) -> str:
    """Markdown with Hub model-card metadata (YAML header: license, base_model, tags, datasets)."""
    meta = {
        "license": info.license,
        "base_model": info.base_model,
        "library_name": "peft" if info.adapter else "transformers",
        "tags": sorted({"alignpipe", *info.tags}),
        "pipeline_tag": "text-generation",
    }
    hub_datasets = [d["path"] for d in info.datasets if d.get("hub")]
    if hub_datasets:
        meta["datasets"] = hub_datasets
    lines = ["---", yaml.safe_dump(meta, sort_keys=False).strip(), "---", "", f"# {info.name}", ""]
    if info.description:
        lines += [info.description, ""]
    kind = "a LoRA adapter for" if info.adapter else "a fine-tune of"
    lines += [f"This model is {kind} `{info.base_model}`, trained by the alignpipe pipeline `{info.pipeline}`.", ""]
    lines += ["## Data", "", "| dataset | source | fingerprint | train rows | eval rows |", "|---|---|---|---|---|"]
    lines += [
        f"| {d['name']} | `{d['path']}` | `{d.get('fingerprint', '')}` | {d.get('rows_train', '')} | {d.get('rows_eval', '')} |"
        for d in info.datasets
    ]
    lines += ["", "## Stages", ""]
    for s in info.stages:
        lines.append(f"### `{s['id']}` ({s['kind']})")
        if s.get("hyperparameters"):
            lines.append("")
            lines.append(", ".join(f"{k}={v}" for k, v in s["hyperparameters"].items()))
        if s.get("metrics"):
            lines += ["", "| metric | value |", "|---|---|"]
            lines += [f"| {k} | {v:.4g} |" for k, v in s["metrics"].items() if isinstance(v, (int, float))]
        lines.append("")
    if info.win_rates:
        lines += [
            "## Judged win rates",
            "",
            "| candidate | baseline | win rate | 95% interval | prompts |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {w['candidate']} | {w['baseline']} | {w['win_rate']:.3f} | [{w['ci_low']:.3f}, {w['ci_high']:.3f}] | {w['n']} |"
            for w in info.win_rates
        ]
        lines.append("")
    lines += [
        "## Reproduce",
        "",
        f"- recipe hash: `{info.recipe_hash}`",
        f"- MLflow run id: `{info.mlflow_run_id}`",
        "",
    ]
    return "\n".join(lines)


def stage_folder(model_dir: Path, dest: Path, card: str) -> Path:
    """Copy the model folder to `dest` (replaced atomically) with README.md = the card."""
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(model_dir, tmp, ignore=shutil.ignore_patterns("checkpoints", "optimizer*", "*.pt"))
    (tmp / "README.md").write_text(card)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def _transient(error: Exception) -> bool:
    """5xx answers and dropped connections are worth retrying; 4xx (auth, bad repo id) are not."""
    if type(error).__name__ == "OfflineModeIsEnabled":  # a ConnectionError, but retrying cannot help
        return False
    response = getattr(error, "response", None)
    status = getattr(response, "status_code", None)
    if status is not None:
        return status >= 500 or status == 429
    return isinstance(error, (ConnectionError, TimeoutError, OSError)) or type(error).__name__ in (
        "ConnectError",
        "ReadTimeout",
        "RemoteProtocolError",
        "ConnectTimeout",
    )


def _with_retries(what: str, fn, attempts: int, backoff_s: float):
    import logging
    import time

    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except Exception as e:
            if attempt == attempts or not _transient(e):
                raise RuntimeError(
                    f"Hub {what} failed after {attempt} attempt(s): {e}. The model and its card are "
                    "still in the stage folder; re-run the pipeline to retry the push."
                ) from e
            delay = backoff_s * 2 ** (attempt - 1)
            logging.getLogger(__name__).warning("Hub %s failed (%s); retrying in %.0fs", what, e, delay)
            time.sleep(delay)


def push_to_hub(
    folder: Path,
    repo_id: str,
    private: bool = False,
    revision: str | None = None,
    commit_message: str = "alignpipe upload",
    endpoint: str | None = None,
    attempts: int = 4,
    backoff_s: float = 2.0,
) -> str:
    """Create the repo (and branch) if needed and upload `folder`, retrying transient failures with
    exponential backoff. Returns the commit URL. The token comes from the environment (HF_TOKEN)."""
    from huggingface_hub import HfApi

    api = HfApi(endpoint=endpoint)
    _with_retries(
        "create_repo",
        lambda: api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model"),
        attempts,
        backoff_s,
    )
    if revision:
        _with_retries(
            "create_branch", lambda: api.create_branch(repo_id, branch=revision, exist_ok=True), attempts, backoff_s
        )
    info = _with_retries(
        "upload",
        lambda: api.upload_folder(
            repo_id=repo_id, folder_path=str(folder), revision=revision, commit_message=commit_message
        ),
        attempts,
        backoff_s,
    )
    return str(getattr(info, "commit_url", info))
