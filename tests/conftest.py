"""Shared fixtures: the tiny assets (made once per session) and one Prefect test harness."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # no telemetry calls off this machine
os.environ.setdefault("DO_NOT_TRACK", "1")


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Path:
    """`alignpipe make-tiny` output: model/ (tokenizer + Llama) and data/*.jsonl."""
    from alignpipe.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("assets") / "tiny")


def tiny_split(tiny: Path, name: str, fmt: str, rows: int | None = None, **kwargs):
    """(tokenizer, train rows, eval rows) of the tiny data file `name`.jsonl, formatted as `fmt` (10% held out)."""
    import json

    from alignpipe.data.formats import format_rows
    from alignpipe.modeling import load_tokenizer

    tok = load_tokenizer(str(tiny / "model"))
    raw = [json.loads(line) for line in (tiny / "data" / f"{name}.jsonl").read_text().splitlines()][:rows]
    train, evals, _ = format_rows(raw, fmt=fmt, tokenizer=tok, eval_fraction=0.1, **kwargs)
    return tok, train, evals


@pytest.fixture(scope="session")
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


def demo_recipe(tiny: Path, workdir: Path, **extra) -> str:
    """pipelines/tiny-demo.yaml with absolute asset paths and a private workdir."""
    text = (Path(__file__).parents[1] / "pipelines" / "tiny-demo.yaml").read_text()
    text = text.replace("assets/tiny", str(tiny)).replace("./runs", str(workdir))
    return text


@pytest.fixture
def demo_text(tiny, tmp_path) -> str:
    return demo_recipe(tiny, tmp_path / "runs")
