"""The pipeline's scheduling decisions without Prefect: which stages run, wait, are reused, skipped or not run."""

import pytest

from alignpipe.manifest import Manifest
from alignpipe.plan import plan
from alignpipe.recipe import load_recipe
from alignpipe.schedule import Schedule


@pytest.fixture()
def recipe(demo_text, tmp_path):
    path = tmp_path / "tiny-demo.yaml"
    path.write_text(demo_text)
    return load_recipe(str(path))


def manifest(stage_id: str, kind: str, **metrics) -> dict:
    return Manifest(stage_id=stage_id, kind=kind, cache_key="k", metrics=metrics).model_dump()


def ready_ids(schedule: Schedule) -> list[tuple[str, str | None]]:
    return [(s.id, o.status if o else None) for s, o in schedule.ready()]


def test_stages_start_when_their_dependencies_finish_and_the_gate_decides(recipe):
    schedule = Schedule(recipe, plan(recipe))
    assert ready_ids(schedule) == [("sft-data", None), ("eval-prompts", None)]
    assert ready_ids(schedule) == []  # both still running
    schedule.finish("sft-data", "format", manifest("sft-data", "format"))
    assert ready_ids(schedule) == [("sft", None)]
    schedule.finish("sft", "sft", manifest("sft", "sft"))
    assert ready_ids(schedule) == []  # judge also needs eval-prompts
    schedule.finish("eval-prompts", "format", manifest("eval-prompts", "format"))
    assert ready_ids(schedule) == [("judge", None)]
    schedule.finish("judge", "judge", manifest("judge", "judge", **{"judge/win_rate": 0.5, "judge/ci_low": 0.4}))
    [(publish, outcome)] = list(schedule.ready())
    assert publish.id == "publish" and outcome.status == "skipped"
    assert outcome.message.startswith("gate `judge.win_rate >= 0.55") and "0.5 >= 0.55 → false" in outcome.message
    assert schedule.settled
    assert [o.status for o in schedule.ordered()] == ["done", "done", "done", "done", "skipped"]


def test_a_failure_marks_only_its_dependents_not_run(recipe):
    schedule = Schedule(recipe, plan(recipe))
    list(schedule.ready())
    failed = schedule.finish("sft-data", "format", RuntimeError("bad row 3\ntraceback..."))
    assert failed.status == "failed" and failed.message == "bad row 3"
    assert ready_ids(schedule) == [("sft", "not run"), ("judge", "not run"), ("publish", "not run")]
    assert not schedule.settled  # eval-prompts, on another branch, is still running
    schedule.finish("eval-prompts", "format", manifest("eval-prompts", "format"))
    assert schedule.settled
    assert [o.status for o in schedule.ordered()] == ["failed", "done", "not run", "not run", "not run"]


def test_finished_stages_are_reused_and_their_manifests_feed_downstream(recipe):
    first = plan(recipe)
    for sid in ("sft-data", "eval-prompts"):
        p = first[sid]
        p.dir.mkdir(parents=True)
        Manifest(stage_id=sid, kind="format", cache_key=p.key, outputs={"data": str(p.dir)}).write(p.dir)
    schedule = Schedule(recipe, plan(recipe))
    assert ready_ids(schedule) == [("sft-data", "cached"), ("eval-prompts", "cached"), ("sft", None)]
    assert set(schedule.inputs("sft")) == {"sft-data"}
    assert schedule.inputs("sft")["sft-data"].outputs["data"] == str(first["sft-data"].dir)


def test_a_gate_on_a_missing_metric_fails_the_stage_with_the_reason(recipe):
    schedule = Schedule(recipe, plan(recipe))
    list(schedule.ready())
    for sid, kind in (("sft-data", "format"), ("eval-prompts", "format")):
        schedule.finish(sid, kind, manifest(sid, kind))
    list(schedule.ready())
    schedule.finish("sft", "sft", manifest("sft", "sft"))
    list(schedule.ready())
    schedule.finish("judge", "judge", manifest("judge", "judge", **{"judge/win_rate": 0.9}))
    [(_, outcome)] = list(schedule.ready())
    assert (
        outcome.status == "failed" and "gate `when: judge.win_rate" in outcome.message and "ci_low" in outcome.message
    )
