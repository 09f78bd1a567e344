"""A push to the Hub from this machine, checked before the run: the Hub's `whoami-v2` (a loopback stand-in here,
through `HF_ENDPOINT`'s setting) says whose the token is and what it may write, and a push it cannot make is a
problem of the recipe instead of a failure after the training."""

from __future__ import annotations

import logging

import pytest
from loopback import stand_in_hub

from alignpipe.recipe import RecipeError, hub_refs, parse_recipe, push_access
from alignpipe.recipe.push_access import Rejected, account_of, cannot_write


def answer(role: str, *, orgs=(), scoped=()) -> dict:
    """A `whoami-v2` answer for user alice, in the shape huggingface.co sends (fields this check ignores included)."""
    access: dict = {"displayName": "laptop", "role": role, "createdAt": "2026-07-23T10:27:03.276Z"}
    if role == "fineGrained":
        access["fineGrained"] = {
            "canReadGatedRepos": True,
            "global": ["discussion.write", "post.write"],
            "scoped": [
                {"entity": {"_id": "6a61", "type": kind, "name": name}, "permissions": permissions}
                for kind, name, permissions in scoped
            ],
        }
    return {
        "type": "user",
        "id": "6a61",
        "name": "alice",
        "fullname": "Alice",
        "isPro": False,
        "orgs": [{"type": "org", "name": name, "roleInOrg": role_in} for name, role_in in orgs],
        "auth": {"type": "access_token", "accessToken": access},
    }


WRITE = ["repo.content.read", "repo.access.read", "repo.write"]


@pytest.mark.parametrize(
    ("whoami", "repo_id", "refused"),
    [
        (answer("write"), "alice/m", None),
        (answer("write"), "m", None),  # no namespace: the account's own
        (answer("write", orgs=[("lab", "write")]), "lab/m", None),
        (answer("write", orgs=[("lab", "contributor")]), "lab/m", None),  # may create; the Hub decides the rest
        (answer("write", orgs=[("lab", "read")]), "lab/m", "has the read role in 'lab'"),
        (answer("write", orgs=[("lab", "admin")]), "other/m", "is not a member of 'other'"),
        (answer("read"), "alice/m", "is read-only"),
        (answer("fineGrained", scoped=[("user", "alice", WRITE)]), "alice/m", None),
        (answer("fineGrained", scoped=[("org", "lab", WRITE)]), "lab/m", None),
        (answer("fineGrained", scoped=[("model", "lab/m", ["repo.write"])]), "lab/m", None),  # one repository
        (answer("fineGrained", scoped=[("model", "lab/m", ["repo.write"])]), "lab/n", "fine-grained without write"),
        (answer("fineGrained", scoped=[("user", "alice", ["repo.content.read"])]), "alice/m", "fine-grained"),
        ({"name": "alice", "auth": {}}, "other/m", None),  # an answer that says nothing refuses nothing
        (
            {
                **answer("fineGrained"),
                "auth": {"accessToken": {"role": "fineGrained", "fineGrained": {"global": ["repo.write"]}}},
            },
            "alice/m",
            None,
        ),
    ],
)
def test_what_the_hub_says_of_the_token_decides_whether_a_push_can_write(whoami, repo_id, refused):
    verdict = cannot_write(account_of(whoami), repo_id, "HF_TOKEN", "https://hub.example")
    if refused is None:
        assert verdict is None
    else:
        assert verdict is not None and refused in verdict[0], verdict
        assert verdict[1]  # and a fix
    rejected = cannot_write(Rejected(), "alice/m", "HF_TOKEN", "https://hub.example")
    assert rejected is not None and "expired, revoked" in rejected[0]


TOKENS = {
    "hf_write_secret": answer("write", orgs=[("lab", "write")]),
    "hf_read_secret": answer("read"),
    "hf_lab_reader_secret": answer("write", orgs=[("lab", "read")]),
}


def whoami_hub(method, path, body, headers):
    """`/api/whoami-v2` for the tokens above; any other token is revoked (401, as huggingface.co answers)."""
    if path != "/api/whoami-v2":
        return 404, {"error": "not found"}
    token = (headers.get("authorization") or headers.get("Authorization") or "").removeprefix("Bearer ")
    if token in TOKENS:
        return 200, TOKENS[token]
    return 401, {"error": "Invalid credentials in Authorization header"}


@pytest.fixture
def fake_hub(monkeypatch):
    with stand_in_hub(monkeypatch, whoami_hub, push_access._whoami, hub_refs.note_once) as url:
        yield url


def pushing_to(repo_id: str) -> list[str]:
    return ["stages.publish.target=hub", f"stages.publish.repo_id={repo_id}"]


def test_a_push_the_token_cannot_make_is_refused_before_the_run_naming_the_account_never_the_token(
    demo_text, fake_hub, monkeypatch
):
    monkeypatch.setenv("HF_TOKEN", "hf_read_secret")
    with pytest.raises(RecipeError) as e:
        parse_recipe(demo_text, pushing_to("alice/tiny"), to_run=True)
    text = str(e.value)
    assert "stages[4].repo_id (stage 'publish'), from --set stages.publish.repo_id=alice/tiny" in text, text
    assert "the token here (HF_TOKEN, 'laptop' of account 'alice') is read-only" in text
    assert f"create a token with write access at {fake_hub}/settings/tokens" in text
    parse_recipe(demo_text, pushing_to("alice/tiny"))  # `show` and other readers do not ask

    monkeypatch.setenv("HF_TOKEN", "hf_lab_reader_secret")
    with pytest.raises(RecipeError, match="has the read role in 'lab'"):
        parse_recipe(demo_text, pushing_to("lab/tiny"), to_run=True)
    with pytest.raises(RecipeError, match="is not a member of 'other'"):
        parse_recipe(demo_text, pushing_to("other/tiny"), to_run=True)
    parse_recipe(demo_text, pushing_to("alice/tiny"), to_run=True)

    monkeypatch.setenv("HF_TOKEN", "hf_revoked_secret")
    with pytest.raises(RecipeError) as e:
        parse_recipe(demo_text, pushing_to("alice/tiny"), to_run=True)
    assert "the Hub rejects the token here (HF_TOKEN): expired, revoked or mistyped" in str(e.value)

    monkeypatch.setenv("HF_TOKEN", "hf_write_secret")
    parse_recipe(demo_text, pushing_to("lab/tiny"), to_run=True)
    parse_recipe(demo_text, pushing_to("alice/tiny"), to_run=True)

    asked = [r["headers"].get("authorization") for r in fake_hub.requests]
    assert asked == [f"Bearer {t}" for t in ("hf_read_secret", "hf_lab_reader_secret", "hf_revoked_secret")] + [
        "Bearer hf_write_secret"
    ], "each token asked about once a process"
    for token in TOKENS:
        assert token not in text


def test_a_push_with_its_token_elsewhere_or_a_hub_that_cannot_be_asked_is_left_to_the_push(
    demo_text, fake_hub, monkeypatch, caplog
):
    from huggingface_hub import constants

    from alignpipe.launch import free_port

    monkeypatch.setenv("HF_TOKEN", "hf_read_secret")
    parse_recipe(demo_text, [*pushing_to("alice/tiny"), "stages.publish.token_secret=hf-token"], to_run=True)
    parse_recipe(demo_text, [*pushing_to("alice/tiny"), "stages.publish.resources.pool=gpu"], to_run=True)
    assert fake_hub.requests == []  # a Secret block's token or a pool's workers': not this machine's to check

    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    with caplog.at_level(logging.WARNING, logger="alignpipe.recipe"):
        parse_recipe(demo_text, pushing_to("alice/tiny"), to_run=True)
        parse_recipe(demo_text, pushing_to("alice/tiny"), to_run=True)
    notes = [r.getMessage() for r in caplog.records if r.name == "alignpipe.recipe"]
    assert len(notes) == 1 and "could not be asked whose the token here is" in notes[0], notes
    assert "alice/tiny was not checked" in notes[0] and "hf_read_secret" not in notes[0]

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "ENDPOINT", fake_hub)
    parse_recipe(demo_text, pushing_to("alice/tiny"), to_run=True)  # offline: asks nothing
    assert fake_hub.requests == []


def test_validate_refuses_a_read_only_token_s_push_and_exits_2(demo_text, fake_hub, tmp_path):
    """The CLI as a user runs it, with the Hub and token from its environment."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    recipe = tmp_path / "demo.yaml"
    recipe.write_text(demo_text)
    env = {**os.environ, "HF_ENDPOINT": str(fake_hub), "HF_HUB_OFFLINE": "0", "HF_HOME": str(tmp_path / "hf")}
    cli = str(Path(sys.executable).parent / "alignpipe")
    sets = [arg for kv in pushing_to("alice/tiny") for arg in ("--set", kv)]
    outs = {
        token: subprocess.run(
            [cli, "validate", str(recipe), *sets],
            env={**env, "HF_TOKEN": token},
            capture_output=True,
            text=True,
            timeout=120,
        )
        for token in ("hf_read_secret", "hf_write_secret")
    }
    read, write = outs["hf_read_secret"], outs["hf_write_secret"]
    assert read.returncode == 2 and "stages[4].repo_id" in read.stderr and "is read-only" in read.stderr, read.stderr
    assert write.returncode == 0, write.stderr
    assert not any(token in out.stdout + out.stderr for token, out in outs.items())
    assert [r["path"] for r in fake_hub.requests] == ["/api/whoami-v2"] * 2


PUSH_TO_HUB = ["stages.publish.target=hub", "stages.publish.repo_id=org/tiny-demo"]


@pytest.fixture
def no_token(monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-login" / "token"))


def test_a_push_to_the_hub_from_a_machine_without_a_token_is_refused_before_the_run(demo_text, no_token, monkeypatch):
    """validate, run and the flow (`to_run`) refuse it; `show` and other readers of the recipe do not ask."""
    with pytest.raises(RecipeError) as e:
        parse_recipe(demo_text, PUSH_TO_HUB, to_run=True)
    text = str(e.value)
    assert "stages[4].target (stage 'publish'), from --set stages.publish.target=hub" in text, text
    assert "stage 'publish' pushes to the Hub (org/tiny-demo), and this machine has no Hub token" in text
    assert "export HF_TOKEN=" in text and "token_secret" in text and "target: local" in text
    parse_recipe(demo_text, PUSH_TO_HUB)  # not asked to run
    # a token in the environment, a Prefect Secret block, or a pool's workers: the push has one where it runs
    parse_recipe(demo_text, [*PUSH_TO_HUB, "stages.publish.token_secret=hf-token"], to_run=True)
    parse_recipe(demo_text, [*PUSH_TO_HUB, "stages.publish.resources.pool=gpu"], to_run=True)
    parse_recipe(demo_text, PUSH_TO_HUB + ["stages.publish.target=local"], to_run=True)
    monkeypatch.setenv("HF_TOKEN", "hf_write_secret")
    parse_recipe(demo_text, PUSH_TO_HUB, to_run=True)


def test_validate_says_a_push_has_no_token_and_exits_2(demo_text, tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    recipe = tmp_path / "demo.yaml"
    recipe.write_text(demo_text)
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")}
    env["HF_HOME"] = str(tmp_path / "hf-home")  # no saved login
    cli = str(Path(sys.executable).parent / "alignpipe")
    sets = [arg for kv in PUSH_TO_HUB for arg in ("--set", kv)]
    out = subprocess.run([cli, "validate", str(recipe), *sets], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "this machine has no Hub token" in out.stderr, out.stderr
    out = subprocess.run([cli, "show", str(recipe), *sets], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


@pytest.fixture
def secret_blocks(prefect_harness):
    """Secret blocks on the test harness's Prefect server: one per token above, and one that holds a JSON object."""
    from prefect.blocks.system import Secret

    for name, value in [
        ("ap-write", "hf_write_secret"),
        ("ap-read", "hf_read_secret"),
        ("ap-revoked", "hf_revoked_secret"),
        ("ap-json", {"token": "hf_write_secret"}),
    ]:
        Secret(value=value).save(name, overwrite=True)


def with_block(name: str, repo_id: str = "alice/tiny") -> list[str]:
    return [*pushing_to(repo_id), f"stages.publish.token_secret={name}"]


def test_a_push_s_secret_block_is_checked_when_the_run_starts_never_showing_the_token(
    demo_text, fake_hub, secret_blocks, monkeypatch
):
    """`validate` cannot see the Prefect server's blocks; `run` and the flow ask it before any stage: the block exists,
    holds a token, and the Hub lets that token write the repository."""
    from flows.preflight import check_prefect, needs_prefect

    monkeypatch.setenv("HF_TOKEN", "hf_read_secret")  # this machine's token plays no part: the block's does

    def problems(*sets: str) -> str:
        recipe = parse_recipe(demo_text, list(sets), to_run=True)  # the recipe itself is fine
        assert needs_prefect(recipe)
        with pytest.raises(RecipeError) as e:
            check_prefect(recipe)
        text = str(e.value)
        assert not any(token in text for token in TOKENS) and "hf_revoked_secret" not in text
        return text

    text = problems(*with_block("ap-wirte"))
    assert "stages[4].token_secret (stage 'publish')" in text, text
    assert "reads its Hub token from Prefect Secret block 'ap-wirte', which this Prefect server does not have" in text
    assert "'ap-write'" in text and "Secret(value=<token>).save('ap-wirte')" in text  # the names it has; the fix

    assert "Prefect Secret block 'ap-json' holds no Hub token" in problems(*with_block("ap-json"))

    text = problems(*with_block("ap-read"))
    assert "stage 'publish' pushes to 'alice/tiny', and the token (Prefect Secret block 'ap-read', 'laptop' of " in text
    assert "account 'alice') is read-only" in text and "stages[4].token_secret" in text
    assert "Secret(value=<it>).save('ap-read', overwrite=True)" in text

    assert "the Hub rejects the token (Prefect Secret block 'ap-revoked')" in problems(*with_block("ap-revoked"))
    assert "has the read role in 'lab'" not in problems(*with_block("ap-read", "lab/tiny"))

    # a pushing stage on a work pool reads the same block: checked too, beside its pool
    text = problems(*with_block("ap-read"), "stages.publish.resources.pool=gpu-pool")
    assert "work pool 'gpu-pool' does not exist" in text and "is read-only" in text

    check_prefect(parse_recipe(demo_text, with_block("ap-write", "lab/tiny"), to_run=True))
    check_prefect(parse_recipe(demo_text, [*with_block("ap-read"), "stages.publish.target=local"], to_run=True))
    assert not needs_prefect(parse_recipe(demo_text, pushing_to("alice/tiny")))
    asked = [r["headers"].get("authorization") for r in fake_hub.requests]
    assert sorted(asked) == sorted(f"Bearer {t}" for t in ("hf_read_secret", "hf_revoked_secret", "hf_write_secret"))


def test_a_pipeline_whose_push_names_a_missing_block_fails_before_any_stage(
    demo_text, fake_hub, secret_blocks, tmp_path
):
    """Launched from the UI or a schedule (no CLI before it), the flow itself refuses, with nothing trained."""
    from flows.pipeline import pipeline

    path = tmp_path / "demo.yaml"
    path.write_text(demo_text)
    state = pipeline(recipe_path=str(path), overrides=with_block("no-such-block"), return_state=True)
    assert state.is_failed()
    assert "Prefect Secret block 'no-such-block', which this Prefect server does not have" in str(state.message)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("manifest.json"))


def test_validate_and_run_refuse_a_missing_block_and_exit_2_before_a_flow_run(demo_text, secret_blocks, tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    from prefect.client.orchestration import get_client
    from prefect.settings import get_current_settings

    recipe = tmp_path / "demo.yaml"
    recipe.write_text(demo_text)
    api = get_current_settings().api.url
    assert api, "the harness serves an API"
    with get_client(sync_client=True) as client:
        before = len(client.read_flow_runs())
    env = {**os.environ, "PREFECT_API_URL": api, "HF_HUB_OFFLINE": "1", "HF_TOKEN": "hf_unused"}
    sets = [arg for kv in with_block("no-such-block") for arg in ("--set", kv)]
    cli = str(Path(sys.executable).parent / "alignpipe")
    for command in ("validate", "run"):
        out = subprocess.run([cli, command, str(recipe), *sets], env=env, capture_output=True, text=True, timeout=180)
        assert out.returncode == 2, out.stdout + out.stderr
        assert f"error: {recipe} is invalid (1 problem)" in out.stderr, out.stderr
        assert "stages[4].token_secret" in out.stderr and "'no-such-block'" in out.stderr, out.stderr
    with get_client(sync_client=True) as client:
        assert len(client.read_flow_runs()) == before, "no flow run was created"
    sets = [arg for kv in with_block("ap-write") for arg in ("--set", kv)]
    out = subprocess.run([cli, "validate", str(recipe), *sets], env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0 and "is valid" in out.stdout, out.stderr


def test_a_token_pasted_as_the_block_name_is_refused_without_repeating_it(demo_text):
    with pytest.raises(RecipeError) as e:
        parse_recipe(demo_text, with_block("hf_AbCdEf0123456789"))
    text = str(e.value)
    assert "stages[4].token_secret" in text and "is the name of a Prefect Secret block" in text, text
    assert "hf_AbCdEf0123456789" not in text
