"""`resources.timeout_s` kills a stage that hangs without printing anything, and says so."""

from __future__ import annotations

import json
import time

import pytest

from alignpipe.launch import StageTimedOut, launch
from alignpipe.pipeline_run import start_pipeline_run
from alignpipe.plan import plan, write_spec
from alignpipe.recipe import parse_recipe

SLEEPY = """
import time


def score(prompts, completions, **_):
    time.sleep(600)  # a scorer that never answers, and prints nothing while it waits
    return [0.0] * len(completions)
"""


def test_a_silent_hang_is_killed_at_timeout_s_and_the_error_names_it(tiny, tmp_path, monkeypatch):
    (tmp_path / "sleepy_scorer.py").write_text(SLEEPY)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["The film", "Critics say"]))
    recipe = parse_recipe(
        f"name: hang\nworkdir: {tmp_path / 'runs'}\nmodel: {{path: {tiny / 'model'}}}\nstages:\n"
        f"  - {{id: judge, kind: judge, candidate: {tiny / 'model'}, baseline: base, prompts_file: {prompts},\n"
        "     num_prompts: 2, reward: 'sleepy_scorer:score', sampling: {max_new_tokens: 4},\n"
        "     resources: {timeout_s: 20}}\n"
    )
    stage = recipe.stages[0]
    spec = write_spec(recipe, plan(recipe)["judge"], {}, start_pipeline_run(recipe, "t"), "t")
    started = time.monotonic()
    with pytest.raises(StageTimedOut) as err:
        launch(spec, on_line=lambda line: None, timeout_s=stage.resources.timeout_s)
    elapsed = time.monotonic() - started
    assert 20 <= elapsed < 90, elapsed
    assert "stage 'judge' timed out: killed after 20 s (resources.timeout_s: 20)" in str(err.value)
