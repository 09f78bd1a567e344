"""A recipe run twice, in two fresh workdirs, gives byte-identical stage outputs: datasets, weights, tokenizers,
judge results, samples. What differs is the run's identity only: manifests (durations, host, MLflow run ids), spec
files and MLflow run markers, and the workdir's own path where a file names it (a LoRA adapter's base model)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import pytest

from alignpipe.launch import launch
from alignpipe.pipeline_run import start_pipeline_run
from alignpipe.plan import plan, write_spec
from alignpipe.recipe import parse_recipe

ROOT = Path(__file__).resolve().parents[1]
RUN_IDENTITY = {"manifest.json", "spec.json", "mlflow_run_id"}


def run_all(text: str, workdir: Path, overrides: list[str]):
    """Every stage in order through the stage launcher (as the flow does, without Prefect)."""
    recipe = parse_recipe(text.replace("./runs", str(workdir)), overrides)
    plans = plan(recipe)
    tracking = start_pipeline_run(recipe, "repro")
    done: dict[str, Any] = {}
    for s in recipe.topological_order():
        inputs = {a: done[a] for a in recipe.ancestors(s.id)}
        done[s.id] = launch(write_spec(recipe, plans[s.id], inputs, tracking, "repro"), on_line=lambda line: None)
    return recipe, done


def digests(stage_dir: Path, workdir: Path) -> dict[str, str]:
    out = {}
    for f in sorted(p for p in stage_dir.rglob("*") if p.is_file() and p.name not in RUN_IDENTITY):
        data = f.read_bytes().replace(str(workdir).encode(), b"<workdir>")
        out[str(f.relative_to(stage_dir))] = hashlib.sha256(data).hexdigest()
    return out


def assert_identical_runs(tiny: Path, tmp_path: Path, recipe_file: str, overrides: list[str]) -> None:
    text = (ROOT / "pipelines" / recipe_file).read_text().replace("assets/tiny", str(tiny))
    from concurrent.futures import ThreadPoolExecutor

    # The two runs side by side (their stages are processes of their own), one torch thread each: with a thread per
    # core, two stages' OpenMP pools spin against each other (on 2 cores tiny-ppo's 150 SFT steps took minutes, not
    # the ~15 s one stage alone takes). Both runs use the same count, so their bytes still compare.
    with pytest.MonkeyPatch.context() as env, ThreadPoolExecutor(2) as pool:
        env.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
        runs = list(pool.map(lambda name: run_all(text, tmp_path / name, overrides), ("first", "second")))
    (recipe, first), (_, second) = runs
    for s in recipe.topological_order():
        a, b = first[s.id], second[s.id]
        assert a.metrics == b.metrics, (s.id, a.metrics, b.metrics)
        folder_a = tmp_path / "first" / recipe.name / "stages"
        folder_b = tmp_path / "second" / recipe.name / "stages"
        stage_a = next(p for p in folder_a.iterdir() if p.is_dir() and p.name.startswith(s.id + "-"))
        stage_b = folder_b / stage_a.name  # same cache key, same folder name
        files_a, files_b = digests(stage_a, tmp_path / "first"), digests(stage_b, tmp_path / "second")
        assert files_a, f"stage {s.id} wrote nothing into {stage_a}"
        assert files_a.keys() == files_b.keys(), (s.id, sorted(files_a.keys() ^ files_b.keys()))
        differ = sorted(k for k in files_a if files_a[k] != files_b[k])
        assert not differ, f"stage {s.id}: files differ between the two runs: {differ}"


def test_a_short_grpo_pipeline_is_byte_identical_twice(tiny, tmp_path):
    """format → SFT → GRPO → judge at 10 steps each (the full tiny-ppo and tiny-grpo recipes: `make test-slow`)."""
    assert_identical_runs(
        tiny,
        tmp_path,
        "tiny-grpo.yaml",
        [
            "stages.sft.max_steps=10",
            "stages.grpo.max_steps=10",
            "stages.grpo.batch_size=16",
            "stages.grpo.num_generations=4",
            "stages.grpo.sample_every=5",
            "stages.judge.num_prompts=16",
        ],
    )


@pytest.mark.slow
@pytest.mark.parametrize("recipe_file", ["tiny-ppo.yaml", "tiny-grpo.yaml"])
def test_tiny_recipes_are_byte_identical_twice(tiny, tmp_path, recipe_file):
    assert_identical_runs(tiny, tmp_path, recipe_file, [])
