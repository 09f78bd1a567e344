"""`resources.timeout_s` kills a stage that hangs without printing anything, and says so."""

from __future__ import annotations

import json
import time

import pytest

from alignpipe.launch import StageFailed, StageTimedOut, launch
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


@pytest.fixture
def silent_server():
    """A TCP server that accepts connections and never answers."""
    import socket
    import threading

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    held, stop = [], threading.Event()

    def accept():
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(sock.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    stop.set()
    thread.join(timeout=2)
    for conn in held:
        conn.close()
    sock.close()


def test_remote_scorer_and_judge_that_never_answer_fail_after_bounded_retries(silent_server):
    from alignpipe.judges.pairwise import EndpointJudge
    from alignpipe.judges.rewards import HTTPScorer, RewardFunctionError

    started = time.monotonic()
    with pytest.raises(
        RewardFunctionError, match=r"remote reward http://127\.0\.0\.1:\d+/score: ReadTimeout.*after 2 attempt"
    ):
        HTTPScorer(silent_server + "/score", timeout_s=0.5, retries=2)(["p"], ["c"])
    assert time.monotonic() - started < 10, "0.5 s per attempt, 2 attempts, 1 s back-off"

    started = time.monotonic()
    judge = EndpointJudge(silent_server, model="judge", timeout_s=0.5, retries=2)
    with pytest.raises(RuntimeError, match=r"LLM judge .*/v1/chat/completions: .*Timeout.*after 2 attempt"):
        judge(["which is better?"])
    assert time.monotonic() - started < 10


def test_a_failed_stage_leads_with_the_cause_its_process_logged():
    tail = [
        "sft step 2/6 loss=5.2",
        "stage sft failed: saving checkpoint /w/step-4 failed: [Errno 28] No space left on device",
        "Traceback (most recent call last):",
        "OSError: [Errno 28] No space left on device",
    ]
    first_line = str(StageFailed("sft", 1, tail)).split("\n")[0]
    assert first_line == (
        "stage 'sft' failed (exit code 1): saving checkpoint /w/step-4 failed: [Errno 28] No space left on device. "
        "Last output:"
    )
    assert str(StageFailed("sft", -9, ["sft step 2/6"])).startswith("stage 'sft' failed (exit code -9). Last output:")
    # Prefect logs the exception's repr on one line: the headline, not the last lines' escaped newlines
    assert repr(StageFailed("sft", 1, tail)) == (
        "StageFailed(\"stage 'sft' failed (exit code 1): saving checkpoint /w/step-4 failed: [Errno 28] No space left "
        'on device")'
    )


def test_a_failure_logged_as_it_came_carries_its_headline_only_and_survives_a_pickle():
    """The local task's run log showed the stage's lines as they came, so the exception Prefect prints twice more
    (traceback, final state) is the headline; `tail` keeps the lines. A failure pickles and copies whole (its args
    are not its __init__'s)."""
    import copy
    import pickle

    from alignpipe.launch import LOGGED_ABOVE

    tail = ["stage sft failed: out of memory", "Traceback (most recent call last):", "torch.OutOfMemoryError: CUDA"]
    failure = StageFailed("sft", 1, tail)
    shown = failure.logged_above()
    assert str(shown) == "stage 'sft' failed (exit code 1): out of memory" + LOGGED_ABOVE
    assert type(shown) is StageFailed and shown.tail == tail and "Last output:" in str(failure)
    timed_out = StageTimedOut("sft", -9, 5.0, tail).logged_above()
    assert isinstance(timed_out, StageTimedOut) and timed_out.timeout_s == 5.0 and "\n" not in str(timed_out)
    for original in (failure, timed_out):
        for again in (pickle.loads(pickle.dumps(original)), copy.copy(original)):
            assert type(again) is type(original) and str(again) == str(original)
            assert again.tail == tail and again.headline == original.headline
