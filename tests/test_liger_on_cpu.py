"""TRL + Liger's benchmark contenders run on the CPU, Liger's kernels in Triton's interpreter (`bench.liger_cpu`):
what a GPU lease would otherwise find at its first step (session 42's lost its reward row that way). Minutes of
interpreted kernels, so in `make test-slow`."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="liger-kernel is in the test extra"),
]
ROOT = Path(__file__).parents[1]


def test_every_trl_with_liger_contender_trains_the_users_shrunk_cases_with_plain_trl_s_loss(tiny):
    out = subprocess.run(
        [sys.executable, "-m", "bench.liger_cpu", "--assets", str(tiny)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    rows = {line.split("|")[1].strip().split("/")[0]: line for line in out.stdout.splitlines()[2:]}
    assert set(rows) == {"sft", "reward", "dpo", "grpo"}, out.stdout
    assert all(line.rstrip().endswith("| ok |") for line in rows.values()), out.stdout
    for trainer, line in rows.items():  # TRL 1.16 applies Liger's layer kernels, and its own fused LM head
        assert all(k in line for k in ("rms_norm", "rope", "swiglu")), (trainer, line)
    assert "cross_entropy" not in rows["reward"], "the reward contender leaves the classifier's forward alone"
