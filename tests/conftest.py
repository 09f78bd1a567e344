"""Shared fixtures: the tiny assets (made once per session) and one Prefect test harness."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

# Triton's own jitted helpers (`tl.sigmoid`, `tl.max`, `tl.sum`, which the hand-written kernels call) run in its
# interpreter only if Triton was first imported under it: imported here so, before torch's compiler imports it, and the
# switch cleared again (the `interpreted` fixture sets it for the tests that interpret the kernels). On a GPU, Triton
# compiles them as usual.
if importlib.util.find_spec("triton") is not None:
    _before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        importlib.import_module("triton.language")
    finally:
        if _before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = _before

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


@pytest.fixture(autouse=True)
def _same_random_state_every_test():
    """Each test starts from seed 0, whatever ran before it on its xdist worker: a head drawn at load (a value or
    reward model's) or a random batch is the same draw on every run, so a failure can be run again alone."""
    from alignpipe.trainers.common import seed_everything

    seed_everything(0)


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


@pytest.fixture
def interpreted(monkeypatch):
    """The kernels built for Triton's interpreter, computing as a GPU does where the interpreter does not: casts down
    to bfloat16 round to nearest as `fptrunc` does (the interpreter's own truncates, and its rounding mode drops the
    carry into the exponent), and `tl.fma` rounds once (the interpreter's multiplies, then adds)."""
    pytest.importorskip("triton", reason="the test extra installs Triton (Linux x86-64)")
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    from alignpipe import triton_kernels

    plain = interpreter.InterpreterBuilder.create_fp_trunc

    def fp_trunc(self, src, dst_type):
        if dst_type.scalar != tl.bfloat16:
            return plain(self, src, dst_type)  # float16: numpy's cast rounds to nearest
        rounded = torch.from_numpy(np.asarray(src.data, dtype=np.float32)).to(torch.bfloat16)
        return interpreter.TensorHandle(rounded.view(torch.int16).numpy().view(np.uint16), dst_type.scalar)

    def fma(self, x, y, z):  # float32 operands: their product is exact in float64, the sum rounded (twice, rarely off)
        exact = x.data.astype(np.float64) * y.data.astype(np.float64) + z.data.astype(np.float64)
        return interpreter.TensorHandle(exact.astype(z.data.dtype), z.dtype.scalar)

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_fp_trunc", fp_trunc)
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_fma", fma)
    caches = (
        triton_kernels._kernels,
        triton_kernels.usable,
        triton_kernels.adamw_usable,
        triton_kernels.head_usable,
        triton_kernels.kl_usable,
    )
    for cache in caches:
        cache.cache_clear()
    yield
    for cache in caches:
        cache.cache_clear()
