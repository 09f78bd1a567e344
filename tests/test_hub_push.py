"""`push_to_hub` and the push stage against the loopback stand-in for the Hub: retries with backoff on
transient errors, a clear error (and the local folder intact) when the Hub keeps failing, merged adapters."""

from __future__ import annotations

import json

import pytest
from loopback import FakeHub, serve

from alignpipe.hub import push_to_hub
from alignpipe.recipe.stages import PushStage


@pytest.fixture(autouse=True)
def online(monkeypatch):
    """conftest sets HF_HUB_OFFLINE=1 for the whole suite; these tests talk to a loopback Hub."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")


@pytest.fixture
def folder(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (d / "README.md").write_text("---\nlicense: apache-2.0\n---\n# m\n")
    return d


def test_transient_hub_errors_are_retried_with_backoff(folder, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    hub = FakeHub()
    hub.fail_commits = 2
    with serve(hub) as url:
        push_to_hub(folder, "alice/m", endpoint=url, backoff_s=0.05)
    assert hub.commit_attempts == 3 and len(hub.commits) == 1  # two 503s absorbed by retries
    assert hub.repos["alice/m"]["branches"]["main"]["config.json"]


def test_a_hub_that_keeps_failing_gives_a_clear_error_and_keeps_the_folder(folder, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    hub = FakeHub()
    hub.fail_commits = 99
    # huggingface_hub retries 5xx itself (with its own backoff); one attempt of ours is enough to see the error.
    with (
        serve(hub) as url,
        pytest.raises(
            RuntimeError, match=r"(?s)Hub upload failed after 1 attempt\(s\).*503.*still in the stage folder"
        ),
    ):
        push_to_hub(folder, "alice/m", endpoint=url, attempts=1, backoff_s=0.01)
    assert hub.commit_attempts >= 1 and not hub.commits
    assert (folder / "config.json").exists() and (folder / "README.md").exists()


def test_push_stage_merges_a_lora_adapter_when_asked(tiny, tmp_path):
    from alignpipe.data.formats import format_rows
    from alignpipe.manifest import Manifest
    from alignpipe.modeling import load_causal_lm, load_tokenizer
    from alignpipe.recipe import parse_recipe
    from alignpipe.stages import push as push_stage
    from alignpipe.stages.context import StageContext
    from alignpipe.tracking import Tracker
    from alignpipe.trainers import sft
    from alignpipe.trainers.configs import LoraSpec, SFTConfig

    tok = load_tokenizer(str(tiny / "model"))
    rows = [json.loads(line) for line in (tiny / "data" / "sentiment_sft.jsonl").read_text().splitlines()[:64]]
    train, _, _ = format_rows(rows, fmt="prompt_completion", tokenizer=tok, eval_fraction=0)
    result = sft.train(
        SFTConfig(max_steps=2, batch_size=8, lora=LoraSpec(r=4)),
        load_causal_lm(str(tiny / "model")),
        tok,
        train,
        [],
        Tracker(),
        tmp_path / "sft",
    )
    adapter = Manifest(
        stage_id="sft",
        kind="sft",
        cache_key="k",
        outputs={"model": str(result.model_dir)},
        info={"adapter": True, "base_model_path": str(tiny / "model")},
    )
    recipe = parse_recipe(f"""name: m
model: {{path: {tiny / "model"}}}
stages:
  - {{id: sft-data, kind: format, dataset: d, format: prompt_completion}}
  - {{id: sft, kind: sft, data: sft-data}}
  - {{id: publish, kind: push, model: sft, target: local, path: {tmp_path / "out"}, merge_adapter: true}}
datasets: {{d: {{path: {tiny / "data" / "sentiment_sft.jsonl"}}}}}
""")
    ctx = StageContext(recipe, recipe.stage("publish", PushStage), tmp_path / "publish", {"sft": adapter}, Tracker())
    (tmp_path / "publish").mkdir()
    out = push_stage.run(ctx)
    published = tmp_path / "out"
    assert (published / "model.safetensors").exists() and not (published / "adapter_config.json").exists()
    assert out.info["adapter"] is False and "library_name: transformers" in (published / "README.md").read_text()
    assert load_causal_lm(str(published)) is not None


def test_redaction_masks_credentials_not_hyperparameters_that_mention_tokens(monkeypatch):
    from alignpipe.tracking import redact

    monkeypatch.setenv("HF_TOKEN", "hf_abcdefgh123")
    monkeypatch.setenv("PREFECT_API_AUTH_STRING", "admin:pf-pass-42")
    params = {
        "note": "admin:pf-pass-42",
        "push.hf_token": "x",
        "judge.api_key": "k",
        "db.password": "p",
        "push.token_secret": "hub-token-block",
        "auth.token": "t",
        "extra.header": "hf_abcdefgh123",
        "judge.sampling.max_new_tokens": 32,
        "ppo.logprob_chunk_tokens": 4096,
        "model.tokenizer": "assets/tiny/model",
        "tokenizer.pad_token": "<pad>",
    }
    out = redact(params)
    masked = {k for k, v in out.items() if v == "***"}
    assert masked == {
        "push.hf_token",
        "judge.api_key",
        "db.password",
        "push.token_secret",
        "auth.token",
        "extra.header",
        "note",
    }
    assert out["judge.sampling.max_new_tokens"] == 32 and out["tokenizer.pad_token"] == "<pad>"
