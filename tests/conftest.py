"""Shared fixtures: the tiny assets (made once per session) and one Prefect test harness."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support import demo_recipe

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # no telemetry calls off this machine
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers on two cores: one torch thread each, and in the stage processes they start. With torch's default
    # (a thread per core) their OpenMP pools spin against each other: the suite took 32 minutes instead of 25 here.
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Path:
    """`alignpipe make-tiny` output: model/ (tokenizer + Llama) and data/*.jsonl."""
    from alignpipe.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("assets") / "tiny")


@pytest.fixture(scope="session")
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture
def demo_text(tiny, tmp_path) -> str:
    return demo_recipe(tiny, tmp_path / "runs")
