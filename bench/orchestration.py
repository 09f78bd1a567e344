"""Orchestration overhead: `python -m bench.orchestration [RECIPE...]` runs each tiny recipe as a user does
(`alignpipe run`, ephemeral Prefect server, SQLite MLflow) in a fresh workdir, then once more with every
stage cached, and reports wall time minus the stages' own compute on the DAG's critical path (their
manifests' `duration_s`: model loading, training, evaluation, saving). The difference is what the pipeline machinery
costs: Prefect start-up, the flow and task runs, MLflow runs, and each stage process's start-up (Python,
torch and transformers imports)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(recipe: Path, workdir: Path, env: dict) -> tuple[float, dict]:
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "alignpipe.cli", "run", str(recipe), "--set", f"workdir={workdir}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise RuntimeError(f"{recipe} failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    runs = sorted((workdir).glob("*/runs/*.json"), key=lambda p: p.stat().st_mtime)
    return wall, json.loads(runs[-1].read_text())


def measure(recipe: Path) -> dict:
    from alignpipe.tiny import make_tiny

    make_tiny(ROOT / "assets" / "tiny")
    env = {
        **os.environ,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "PREFECT_HOME": tempfile.mkdtemp(prefix="prefect-home-"),
    }
    workdir = Path(tempfile.mkdtemp(prefix="orchestration-"))
    wall, summary = _run(recipe, workdir, env)
    stages = summary["stages"]
    compute = sum(s["duration_s"] for s in stages if s["status"] == "done")
    critical = critical_path(recipe, {s["stage_id"]: s["duration_s"] if s["status"] == "done" else 0.0 for s in stages})
    ran = sum(1 for s in stages if s["status"] == "done")
    cached_wall, cached = _run(recipe, workdir, env)
    assert all(s["status"] in ("cached", "skipped") for s in cached["stages"]), cached["stages"]
    return {
        "recipe": recipe.name,
        "stages": len(stages),
        "ran": ran,
        "wall_s": wall,
        "compute_s": compute,
        "critical_s": critical,
        "overhead_s": wall - critical,
        "per_stage_s": (wall - critical) / max(1, ran),
        "cached_wall_s": cached_wall,
    }


def critical_path(recipe: Path, seconds: dict[str, float]) -> float:
    """The longest chain of stage compute through the DAG: independent stages run concurrently, so this, not
    the sum, is the compute a flow's wall time has to contain."""
    from alignpipe.recipe.load import load_recipe

    deps = {st.id: st.dependencies() for st in load_recipe(recipe, check_files=False).stages}
    finish: dict[str, float] = {}

    def done_at(sid: str) -> float:
        if sid not in finish:
            finish[sid] = seconds.get(sid, 0.0) + max((done_at(d) for d in deps[sid]), default=0.0)
        return finish[sid]

    return max(done_at(sid) for sid in deps)


def table(rows: list[dict]) -> list[str]:
    lines = [
        "| recipe | stages (ran) | flow wall s | Σ stage compute s | critical-path compute s | overhead s | "
        "overhead per stage s | all-cached re-run s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['recipe']} | {r['stages']} ({r['ran']}) | {r['wall_s']:.1f} | {r['compute_s']:.1f} | "
            f"{r['critical_s']:.1f} | {r['overhead_s']:.1f} | {r['per_stage_s']:.1f} | {r['cached_wall_s']:.1f} |"
        )
    return lines


def main(argv: list[str] | None = None) -> list[str]:
    import datetime

    from bench.__main__ import cpu, write_section

    recipes = [Path(p) for p in (argv or sys.argv[1:])] or [
        ROOT / "pipelines" / "tiny-demo.yaml",
        ROOT / "pipelines" / "tiny-dpo.yaml",
    ]
    lines = [
        "## Orchestration overhead",
        "",
        f"Measured {datetime.date.today()} on {cpu()}: each recipe run as a user runs it (`alignpipe run`, ephemeral "
        "Prefect server, SQLite MLflow) in a fresh workdir, then again with every stage cached. Overhead = flow wall "
        "time − the compute on the DAG's critical path (stages' own `duration_s` from their manifests; independent "
        "stages run concurrently, so the plain sum can exceed the wall time): Prefect start-up, flow and task runs, "
        "MLflow runs, each stage process's start-up and imports.",
        "",
        *table([measure(r) for r in recipes]),
        "",
        "Reproduce: `python -m bench.orchestration [RECIPE...]`.",
        "",
    ]
    write_section(ROOT / "docs" / "benchmarks.md", "orchestration", lines)
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()
