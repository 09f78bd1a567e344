"""Runs that overlap: two processes creating one fresh MLflow SQLite store, and two launches of one stage into one
folder, at the same time."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from typing import Any

from mlflow.tracking import MlflowClient

from alignpipe.launch import launch
from alignpipe.pipeline_run import start_pipeline_run
from alignpipe.plan import plan, write_spec
from alignpipe.recipe import parse_recipe

CREATE = """
import sys, time
from pathlib import Path
from alignpipe.tracking import ensure_experiment
start = float(sys.argv[2])
while time.time() < start:
    time.sleep(0.001)
print(ensure_experiment(sys.argv[1], "overlap", Path(sys.argv[3])))
"""


def test_two_processes_creating_a_fresh_mlflow_store_together_both_get_the_experiment(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    start = str(time.time() + 4)  # both past their imports, then released at the same instant
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CREATE, uri, start, str(tmp_path / "artifacts")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    ids = {out.strip().splitlines()[-1] for out, _ in outs}
    assert len(ids) == 1
    assert {e.name for e in MlflowClient(uri).search_experiments()} == {"overlap", "Default"}


def test_two_launches_of_one_stage_train_it_once_and_both_get_its_manifest(tiny, tmp_path):
    recipe = parse_recipe(
        f"name: overlap\nworkdir: {tmp_path / 'runs'}\nmodel: {{path: {tiny / 'model'}}}\n"
        f"datasets:\n  reviews: {{path: {tiny / 'data' / 'sentiment_sft.jsonl'}}}\n"
        "stages:\n  - {id: data, kind: format, dataset: reviews, format: prompt_completion, max_rows: 200}\n"
        "  - {id: sft, kind: sft, data: data, max_steps: 20, batch_size: 8, logging_every: 5}\n"
    )
    plans = plan(recipe)
    tracking = start_pipeline_run(recipe, "overlap")
    data = launch(write_spec(recipe, plans["data"], {}, tracking, "a"), on_line=lambda line: None)
    spec = write_spec(recipe, plans["sft"], {"data": data}, tracking, "a")
    results: dict[str, Any] = {}
    lines: dict[str, list[str]] = {"a": [], "b": []}

    def run(name: str) -> None:
        results[name] = launch(spec, on_line=lines[name].append)

    threads = [threading.Thread(target=run, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
        time.sleep(0.5)
    for t in threads:
        t.join(timeout=600)
    assert set(results) == {"a", "b"} and results["a"] == results["b"]
    waited = [n for n in lines if any("another run is training it" in line for line in lines[n])]
    reused = [n for n in lines if any("finished by another run; reusing" in line for line in lines[n])]
    assert waited == reused == ["b"], lines["b"][-5:]
    runs = MlflowClient(recipe.tracking_uri).search_runs([tracking[1]], "tags.`alignpipe.stage_id` = 'sft'")
    assert len(runs) == 1, "the stage trained once"
