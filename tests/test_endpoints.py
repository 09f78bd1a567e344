"""HTTP endpoints a stage calls: an LLM judge on an OpenAI-compatible server (`llm_judge: {url, served_model,
api_key_env}`) and a remote scorer (`rewards: [{url, api_key_env}]`). The key goes from its environment variable into
the requests' Authorization header and nowhere else, a hosted API's `.../v1` base URL works as it does in OpenAI's
clients, and `validate` checks before the run that the key's variable is set and asks a judge server's /v1/models,
so that a missing or refused key, or a model the server does not serve, is a problem of the recipe and not a stage
failing after the training."""

from __future__ import annotations

import logging

import pytest
from loopback import serve

from alignpipe.judges.pairwise import EndpointJudge, server_root
from alignpipe.recipe import RecipeError, endpoints, hub_refs, parse_recipe

KEY = "sk-test-judge-key-1234"
SERVED = ["judge-llm", "judge-llm-large"]


def hosted(method, path, body, headers):
    """A hosted API: every call needs `Bearer KEY`; answers A."""
    if {k.lower(): v for k, v in headers.items()}.get("authorization") != f"Bearer {KEY}":
        return 401, {"error": {"message": "Incorrect API key provided", "type": "invalid_request_error"}}
    if path == "/v1/models":
        return 200, {"object": "list", "data": [{"id": m, "object": "model"} for m in SERVED]}
    if path == "/v1/chat/completions":
        return 200, {"choices": [{"message": {"role": "assistant", "content": "A"}}]}
    return 404, {"error": "not found"}


@pytest.fixture
def server():
    endpoints._served.cache_clear()
    hub_refs.note_once.cache_clear()
    with serve(hosted) as url:
        yield url
    endpoints._served.cache_clear()
    hub_refs.note_once.cache_clear()


def judged_by(demo_text: str, spec: str) -> str:
    """The demo recipe with its judge stage (stages[3]) asking `llm_judge: {spec}` instead of a rule."""
    text = demo_text.replace("    reward: sentiment_lexicon ", f"    llm_judge: {{{spec}}} ")
    assert text != demo_text
    return text


def test_the_key_goes_from_its_variable_into_the_header_and_a_v1_base_url_is_the_same_server(
    server, tiny, tmp_path, monkeypatch
):
    from alignpipe.recipe import parse_recipe
    from alignpipe.recipe.stages import JudgeStage
    from alignpipe.stages.context import StageContext
    from alignpipe.stages.judge import local_or_endpoint_judge
    from alignpipe.tracking import Tracker

    assert (
        server_root("https://api.openai.com/v1/") == server_root("https://api.openai.com") == "https://api.openai.com"
    )
    assert EndpointJudge(f"{server}/v1", model="judge-llm", api_key=KEY)(["A or B?"]) == ["A"]
    assert EndpointJudge(f"{server}", api_key=KEY)(["A or B?"]) == ["A"]  # the first model listed
    paths = [r["path"] for r in server.requests]
    assert paths == ["/v1/chat/completions", "/v1/models", "/v1/chat/completions"], paths
    bodies = [r["body"] for r in server.requests if r["body"]]
    assert [b["model"] for b in bodies] == ["judge-llm", "judge-llm"]
    with pytest.raises(RuntimeError, match=r"/v1/models: HTTPStatusError.*401") as e:
        EndpointJudge(server)(["A or B?"])
    assert KEY not in str(e.value)

    (tmp_path / "prompts.jsonl").write_text('{"prompt": "The film"}\n')
    stage = f"""  - id: judge
    kind: judge
    candidate: base
    prompts_file: {tmp_path / "prompts.jsonl"}
    llm_judge: {{url: {server}/v1, served_model: judge-llm-large, api_key_env: JUDGE_TEST_KEY}}
"""
    recipe = parse_recipe(f"name: j\nmodel: {{path: {tiny / 'model'}}}\nstages:\n{stage}", check_files=False)
    stage_spec = recipe.stages[0]
    assert isinstance(stage_spec, JudgeStage) and stage_spec.llm_judge is not None
    ctx = StageContext(recipe, stage_spec, tmp_path, {}, Tracker())
    monkeypatch.delenv("JUDGE_TEST_KEY", raising=False)
    with pytest.raises(ValueError, match="api_key_env names JUDGE_TEST_KEY, which is not set where this stage runs"):
        local_or_endpoint_judge(ctx, stage_spec.llm_judge)
    monkeypatch.setenv("JUDGE_TEST_KEY", KEY)
    name, judge = local_or_endpoint_judge(ctx, stage_spec.llm_judge)
    assert name == f"LLM judge {server}/v1 (judge-llm-large)" and KEY not in name + repr(judge)
    assert judge(["A or B?"]) == ["A"]
    assert server.requests[-1]["body"]["model"] == "judge-llm-large"


def test_the_judge_s_fields_say_what_is_wrong_without_echoing_a_key(demo_text):
    with pytest.raises(RecipeError) as e:
        parse_recipe(judged_by(demo_text, f"url: http://127.0.0.1:9, api_key_env: {KEY}"))
    assert "is the name of an environment variable" in str(e.value) and KEY not in str(e.value)
    with pytest.raises(RecipeError, match="served_model, api_key_env, concurrency: an endpoint judge's"):
        parse_recipe(judged_by(demo_text, "model: base, served_model: x, api_key_env: OPENAI_API_KEY, concurrency: 4"))
    parse_recipe(judged_by(demo_text, "url: http://127.0.0.1:9, served_model: x, api_key_env: OPENAI_API_KEY"))


def test_validate_asks_the_judge_server_before_the_run(demo_text, server, monkeypatch):
    monkeypatch.delenv("JUDGE_TEST_KEY", raising=False)
    spec = f"url: {server}/v1, served_model: judge-llm, api_key_env: JUDGE_TEST_KEY"

    def problems(spec: str) -> str:
        with pytest.raises(RecipeError) as e:
            parse_recipe(judged_by(demo_text, spec), to_run=True)
        assert KEY not in str(e.value)
        return str(e.value)

    text = problems(spec)
    assert "stages[3].llm_judge.api_key_env (stage 'judge')" in text, text
    assert "stage 'judge''s judge needs the API key in JUDGE_TEST_KEY, which is not set on this machine" in text
    assert "export JUDGE_TEST_KEY=<the key>" in text
    assert server.requests == [], "no key, no question"
    parse_recipe(judged_by(demo_text, spec))  # `show` and other readers do not ask

    monkeypatch.setenv("JUDGE_TEST_KEY", "sk-revoked")
    assert f"judge server {server} refuses the key in JUDGE_TEST_KEY (HTTP 401)" in problems(spec)
    assert "stages[3].llm_judge.url" in problems(f"url: {server}") and "refuses a request without an API key" in (
        problems(f"url: {server}")
    )

    monkeypatch.setenv("JUDGE_TEST_KEY", KEY)
    text = problems(spec.replace("served_model: judge-llm", "served_model: judge-lm"))
    assert "stages[3].llm_judge.served_model" in text and "serves no model 'judge-lm' (2 listed at /v1/models)" in text
    assert "set served_model to one it serves: judge-llm" in text
    parse_recipe(judged_by(demo_text, spec), to_run=True)
    parse_recipe(judged_by(demo_text, spec.replace("judge-llm", "judge-llm-large")), to_run=True)
    asked = [{k.lower(): v for k, v in r["headers"].items()}.get("authorization") for r in server.requests]
    assert asked == ["Bearer sk-revoked", None, f"Bearer {KEY}"], "each (server, key) asked once a process"

    requests = len(server.requests)
    parse_recipe(judged_by(demo_text, spec), ["stages.judge.resources.pool=gpu"], to_run=True)
    assert len(server.requests) == requests, "a pool's workers ask from their own network, with their own key"


def test_a_judge_server_that_cannot_be_asked_is_left_to_the_stage_with_one_note(demo_text, server, caplog):
    from alignpipe.launch import free_port

    spec = f"url: http://127.0.0.1:{free_port()}, served_model: judge-llm"  # nothing listens there
    with caplog.at_level(logging.WARNING, logger="alignpipe.recipe"):
        parse_recipe(judged_by(demo_text, spec), to_run=True)
        parse_recipe(judged_by(demo_text, spec), to_run=True)
    notes = [r.getMessage() for r in caplog.records if r.name == "alignpipe.recipe"]
    assert len(notes) == 1 and "could not be asked which models it serves" in notes[0], notes


def test_a_remote_scorer_sends_the_key_from_its_variable_and_validate_wants_it_set(tiny, monkeypatch):
    from pathlib import Path

    from alignpipe.judges.reward_set import load_rewards
    from alignpipe.judges.rewards import HTTPScorer
    from alignpipe.recipe.stages import GRPOStage

    def scorer(method, path, body, headers):
        if {k.lower(): v for k, v in headers.items()}.get("authorization") != f"Bearer {KEY}":
            return 401, {"error": "unauthorised"}
        return 200, {"rewards": [float(len(c)) for c in body["completions"]]}

    grpo = (Path(__file__).parents[1] / "pipelines" / "tiny-grpo.yaml").read_text().replace("assets/tiny", str(tiny))
    monkeypatch.delenv("SCORER_TEST_KEY", raising=False)
    with serve(scorer) as url:
        assert HTTPScorer(url, api_key=KEY)(["p", "q"], ["ab", "c"]) == [2.0, 1.0]
        with pytest.raises(Exception, match="401") as e:
            HTTPScorer(url, retries=1)(["p"], ["ab"])
        assert KEY not in str(e.value)

        remote = grpo.replace(
            "      - {function: exact_match}",
            f"      - {{function: exact_match}}\n      - {{url: {url}/score, api_key_env: SCORER_TEST_KEY}}",
        )
        assert remote != grpo
        with pytest.raises(RecipeError) as e:
            parse_recipe(remote, to_run=True)
        text = str(e.value)
        assert "stages[2].rewards[1].api_key_env (stage 'grpo')" in text, text
        assert f"remote scorer {url}/score needs the API key in SCORER_TEST_KEY, which is not set" in text
        grpo_stage = parse_recipe(remote).stages[2]  # `show` and other readers do not ask
        assert isinstance(grpo_stage, GRPOStage)
        rewards = grpo_stage.rewards
        with pytest.raises(ValueError, match="reward 'remote''s api_key_env names SCORER_TEST_KEY, which is not set"):
            load_rewards(rewards, str)
        parse_recipe(remote, ["stages.grpo.resources.pool=gpu"], to_run=True)  # the workers' environment
        monkeypatch.setenv("SCORER_TEST_KEY", KEY)
        parse_recipe(remote, to_run=True)  # a scorer has no standard question: its variable is what is checked
        assert load_rewards(rewards, str).rewards[1].fn(["p"], ["abc"]) == [3.0]
        assert [r["path"] for r in url.requests] == ["/", "/", "/score"], "validate asked the scorer nothing"

    with pytest.raises(RecipeError, match="api_key_env is a remote scorer's"):
        parse_recipe(grpo.replace("{function: exact_match}", "{function: exact_match, api_key_env: K}"))


def test_a_judge_server_with_no_model_loaded_is_a_problem_unless_one_is_named(demo_text, server):
    def empty(method, path, body, headers):
        return 200, {"object": "list", "data": []}

    with serve(empty) as url:
        with pytest.raises(RecipeError, match=r"llm_judge.url.*lists no model at /v1/models"):
            parse_recipe(judged_by(demo_text, f"url: {url}"), to_run=True)
        with pytest.raises(
            RecipeError, match=r"(?s)serves no model 'j' \(0 listed.*start the server with the judge model"
        ):
            parse_recipe(judged_by(demo_text, f"url: {url}, served_model: j"), to_run=True)


def test_an_endpoint_judge_keeps_requests_in_flight_and_waits_out_a_rate_limit(monkeypatch):
    """Up to `concurrency` requests at once (a server batches them), answers in the prompts' order; a 429 is retried
    after its Retry-After."""
    import threading
    import time

    from alignpipe.judges.http_endpoints import retry_after

    lock, state = threading.Lock(), {"in_flight": 0, "most": 0, "limited": 0}

    def slow(method, path, body, headers):
        prompt = body["messages"][0]["content"]
        if prompt == "limited" and state["limited"] == 0:
            state["limited"] += 1
            return 429, {"error": "rate limited"}, {"Retry-After": "0"}
        with lock:
            state["in_flight"] += 1
            state["most"] = max(state["most"], state["in_flight"])
        time.sleep(0.2)
        with lock:
            state["in_flight"] -= 1
        return 200, {"choices": [{"message": {"content": prompt.upper()}}]}

    prompts = [f"p{i}" for i in range(12)] + ["limited"]
    with serve(slow) as url:
        assert EndpointJudge(url, model="j", concurrency=4)(prompts) == [p.upper() for p in prompts]
        assert 2 <= state["most"] <= 4, state
        assert state["limited"] == 1
        state["most"] = 0
        assert EndpointJudge(url, model="j", concurrency=1)(prompts[:3]) == ["P0", "P1", "P2"]
        assert state["most"] == 1
    assert retry_after(type("R", (), {"headers": {"retry-after": "120"}})()) == 60.0


def test_a_call_is_asked_again_only_while_asking_again_can_help(monkeypatch):
    """Timeouts, resets, 5xx and 429 are asked again, backing off 1, 2 s or by Retry-After; a success or any other
    4xx is the answer at once; after the last attempt its answer (or its transport error) is returned with the count."""
    import httpx

    from alignpipe.judges import http_endpoints

    slept: list[float] = []
    monkeypatch.setattr(http_endpoints.time, "sleep", slept.append)
    request = httpx.Request("POST", "http://server/v1/x")

    def answers(*said):
        queue = list(said)

        def send():
            answer = queue.pop(0)
            if isinstance(answer, Exception):
                raise answer
            status, headers = answer if isinstance(answer, tuple) else (answer, {})
            return httpx.Response(status, headers=headers, request=request)

        return send

    reset = httpx.ConnectError("reset", request=request)
    answer, attempts = http_endpoints.answer_with_retries(answers(reset, 503, 200), retries=3)
    assert (answer.status_code, attempts, slept) == (200, 3, [1, 2])
    slept.clear()
    answer, attempts = http_endpoints.answer_with_retries(answers((429, {"Retry-After": "7"}), 400, 200), retries=3)
    assert (answer.status_code, attempts, slept) == (400, 2, [7.0])
    slept.clear()
    answer, attempts = http_endpoints.answer_with_retries(answers(502, reset), retries=2)
    assert (answer, attempts, slept) == (reset, 2, [1])
    slept.clear()
    answer, attempts = http_endpoints.answer_with_retries(answers(500, 503), retries=2)
    assert (answer.status_code, attempts) == (503, 2)
    with pytest.raises(RuntimeError, match=r"the judge: HTTPStatusError: Server error '503.*after 2 attempt\(s\)"):
        http_endpoints.json_with_retries(answers(500, 503), "the judge", retries=2, timeout_s=5)


def test_a_reasoning_model_s_refused_sampling_fields_are_rewritten_once(caplog):
    """OpenAI's reasoning models refuse `max_tokens` (they take `max_completion_tokens`) and `temperature: 0`, naming
    the field in the error's `param` and `code`: the judge rewrites its request once and sends the rest that way; any
    other 400 fails as before."""
    import logging

    def reasoning(method, path, body, headers):
        if "max_tokens" in body:
            return 400, {
                "error": {
                    "message": "Unsupported parameter: 'max_tokens' is not supported with this model. Use "
                    "'max_completion_tokens' instead.",
                    "type": "invalid_request_error",
                    "param": "max_tokens",
                    "code": "unsupported_parameter",
                }
            }
        if "temperature" in body:
            return 400, {
                "error": {
                    "message": "Unsupported value: 'temperature' does not support 0 with this model.",
                    "type": "invalid_request_error",
                    "param": "temperature",
                    "code": "unsupported_value",
                }
            }
        if body["messages"][0]["content"] == "bad":
            return 400, {"error": {"message": "bad request", "param": "messages", "code": "invalid_value"}}
        return 200, {"choices": [{"message": {"content": "B"}}]}

    with serve(reasoning) as url:
        judge = EndpointJudge(url, model="o-mini", max_new_tokens=512, concurrency=1)
        with caplog.at_level(logging.INFO, logger="alignpipe.judges.pairwise"):
            assert judge(["p1", "p2", "p3"]) == ["B", "B", "B"]
        bodies = [r["body"] for r in url.requests]
        assert len(bodies) == 3 + 2, "two refusals, then every prompt once"
        assert all(b["max_completion_tokens"] == 512 and "temperature" not in b for b in bodies[2:])
        assert judge.sampling == {"max_completion_tokens": 512}
        assert (
            sum(
                "refused max_tokens (unsupported_parameter); sending max_completion_tokens" in m
                for m in caplog.messages
            )
            == 1
        )
        with pytest.raises(RuntimeError, match="400"):
            judge(["bad"])
