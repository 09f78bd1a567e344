"""A recipe's Hub ids asked of the Hub at validation (a loopback stand-in here, through `HF_ENDPOINT`'s setting):
misspelt, private, gated and revision-less ones are problems of the recipe; a Hub that cannot be asked leaves them to
the stages with one note."""

from __future__ import annotations

import logging

import pytest
from loopback import stand_in_hub

from alignpipe.recipe import RecipeError, parse_recipe
from alignpipe.recipe import hub_refs as hub_refs_module
from alignpipe.recipe.hub_refs import hub_refs

SECRET = "hf_secret_never_shown"


def hub(method, path, body, headers):
    """Model `org/model` (public), `org/gated` (gated; this token was not granted it), dataset `org/data` (branch
    main only); anything else is not there."""
    path = path.split("?")[0]
    known = {
        "/api/models/org/model": {"id": "org/model", "sha": "a" * 40},
        "/api/models/org/model/revision/main": {"id": "org/model", "sha": "a" * 40},
        "/api/models/org/gated": {"id": "org/gated", "sha": "b" * 40, "gated": "manual"},
        "/api/datasets/org/data": {"id": "org/data", "sha": "c" * 40},
        "/api/datasets/org/data/revision/main": {"id": "org/data", "sha": "c" * 40},
    }
    if path in known:
        return 200, known[path]
    if path == "/api/models/org/gated/auth-check":
        return 403, {"error": "Access to model org/gated is restricted."}, {"X-Error-Code": "GatedRepo"}
    if "/revision/" in path:
        return 404, {"error": "Invalid rev id"}, {"X-Error-Code": "RevisionNotFound"}
    return 401, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"}


@pytest.fixture
def fake_hub(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", SECRET)
    with stand_in_hub(monkeypatch, hub, hub_refs_module._ask, hub_refs_module.note_once) as url:
        yield url


HUB_RECIPE = [
    "model.tokenizer=org/model",
    "datasets.math={path: org/data, revision: main}",
    "stages.judge.baseline=[base, org/model]",
]


def test_a_recipe_s_hub_ids_are_found_and_each_repository_is_asked_once(demo_text, fake_hub):
    recipe = parse_recipe(demo_text, HUB_RECIPE)
    assert [(r.where, r.repo_id, r.repo_type, r.revision) for r in hub_refs(recipe)] == [
        (("model", "tokenizer"), "org/model", "model", None),
        (("datasets", "math", "path"), "org/data", "dataset", "main"),
        (("stages", 3, "baseline", 1), "org/model", "model", None),
    ]
    asked = [r["path"].split("?")[0] for r in fake_hub.requests]
    assert asked == ["/api/models/org/model", "/api/datasets/org/data/revision/main"]
    assert all(r["headers"].get("authorization") == f"Bearer {SECRET}" for r in fake_hub.requests)
    parse_recipe(demo_text, HUB_RECIPE)  # the flow validates again in the same process: asked once
    assert len(fake_hub.requests) == 2


def test_missing_private_gated_and_revisionless_hub_ids_are_problems_with_their_fix(demo_text, fake_hub):
    with pytest.raises(RecipeError) as e:
        parse_recipe(
            demo_text,
            [
                "model.tokenizer=org/modle",
                "datasets.math={path: org/data, revision: v2}",
                "stages.judge.baseline=[base, org/gated]",
                "stages.judge.candidate=[sft, org/modle]",
            ],
        )
    text = str(e.value)
    assert "(4 problems)" in text, text  # every field naming the misspelt id, the Hub asked once about it
    assert "stages[3].candidate[1] (stage 'judge')" in text
    assert [r["path"] for r in fake_hub.requests].count("/api/models/org/modle") == 1
    assert "model.tokenizer, from --set model.tokenizer=org/modle: no model 'org/modle' on the Hub" in text
    assert f"check the id at {fake_hub}/org/modle" in text and "HF_TOKEN" in text
    assert "datasets.math.revision" in text and "dataset 'org/data' has no revision 'v2' on the Hub" in text
    assert "stages[3].baseline[1] (stage 'judge')" in text and "model 'org/gated' is gated on the Hub" in text
    assert f"accept its terms at {fake_hub}/org/gated" in text
    assert SECRET not in text


def test_a_hub_that_cannot_be_asked_leaves_the_ids_to_the_stages_with_one_note(demo_text, monkeypatch, caplog):
    from huggingface_hub import constants

    from alignpipe.launch import free_port

    hub_refs_module._ask.cache_clear()
    hub_refs_module.note_once.cache_clear()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    with caplog.at_level(logging.WARNING, logger="alignpipe.recipe"):
        parse_recipe(demo_text, ["model.tokenizer=org/modle"])
        parse_recipe(demo_text, ["model.tokenizer=org/modle"])
    notes = [r.getMessage() for r in caplog.records if r.name == "alignpipe.recipe"]
    assert len(notes) == 1 and "could not be asked" in notes[0] and "org/modle" in notes[0], notes
    hub_refs_module._ask.cache_clear()
    hub_refs_module.note_once.cache_clear()


def test_offline_mode_asks_nothing(demo_text, fake_hub, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # HF_HUB_OFFLINE=1, as huggingface_hub reads it
    parse_recipe(demo_text, ["model.tokenizer=org/modle"])
    assert fake_hub.requests == []


def test_a_recipe_with_local_paths_only_asks_nothing(demo_text, fake_hub):
    parse_recipe(demo_text)
    assert fake_hub.requests == []
