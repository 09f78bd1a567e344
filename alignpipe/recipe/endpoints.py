"""The HTTP servers a recipe's stages call, checked before the run: endpoint judges (`llm_judge: {url: ...}`),
remote scorers (`rewards: [{url: ...}]`) and vLLM rollout servers (`rollout: {mode: server}`).

A judge stage runs at a pipeline's end (an RL stage's scorer or an online DPO stage's judge at its first step): a key
that is not set or that the server refuses, or a `served_model` it does not serve, would otherwise fail the stage
after the training. Each key's variable must be set on this machine. A judge server is asked its `/v1/models` once a
process, with the key, and nothing else; a remote scorer has no standard question to ask, so only its key's variable
is checked. A rollout server that a stage loads its LoRA adapter into (`sync: adapter`) is asked whether it has
vLLM's runtime LoRA API, by unloading an adapter no one loaded (which changes nothing there); one said to give its
sampler's log-probs (`logprobs_mode: processed_logprobs`) for one token's log-probs at two temperatures. A server
that cannot be asked (not started yet, a firewall) is left to the stage with one note; a stage on a work pool calls
from its workers, whose network and environment are not this machine's, and is not checked here.
"""

from __future__ import annotations

import difflib
import functools
import os
from dataclasses import dataclass

from alignpipe.judges.http_endpoints import auth_headers
from alignpipe.judges.pairwise import server_root
from alignpipe.recipe.errors import Problem
from alignpipe.recipe.hub_refs import TIMEOUT_S, Unreachable, note_once, unreachable

SHOWN = 8
"""Served models named in a problem: a hosted API lists a hundred."""


@dataclass(frozen=True)
class Refused:
    status: int


def endpoint_problems(recipe) -> list[Problem]:
    """A problem at each endpoint judge or remote scorer that runs here and cannot be called: its key's variable is
    not set, the judge server refuses the key (or the lack of one), or it does not serve the `served_model` asked
    for."""
    problems = []
    for i, stage in enumerate(recipe.stages):
        if stage.resources.pool:
            continue
        for j, reward in enumerate(getattr(stage, "rewards", None) or []):
            if reward.url:
                problems += _unset_key(stage, ("stages", i, "rewards", j), f"remote scorer {reward.url}", reward)
        spec = getattr(stage, "llm_judge", None)
        if spec is not None and spec.url:
            where = ("stages", i, "llm_judge")
            problems += _unset_key(stage, where, "judge", spec) or _judge_server_problems(stage, where, spec)
        rollout = getattr(stage, "rollout", None)
        if rollout is not None and (rollout.backend, rollout.mode) == ("vllm", "server"):
            problems += _rollout_server_problems(stage, ("stages", i, "rollout"), rollout)
    return problems


def _rollout_server_problems(stage, where: tuple, rollout) -> list[Problem]:
    """A rollout server's key that is not set here or that it refuses, a server that `sync: adapter` would load the
    policy's adapter into and that has no runtime LoRA API, one said to give the sampler's log-probs that gives the
    raw model's; a note where its weights will not follow the policy."""
    problems = _rollout_sync_problems(stage, where, rollout)
    if problems or rollout.logprobs_mode != "processed_logprobs":
        return problems
    root, variable = server_root(rollout.server_url), rollout.api_key_env
    answer = _follows_temperature(root, os.environ.get(variable) if variable else None)
    said = _unasked_or_refused(stage, where, root, variable, answer)
    if said is not None:
        return said
    if answer:
        return []
    return [
        Problem(
            (*where, "logprobs_mode"),
            f"stage {stage.id!r}'s vLLM rollout server {root} gives the raw model's "
            "log-probs (the same at temperature 1 and 0.25), not the sampler's: it was not started with "
            "`--logprobs-mode processed_logprobs`",
            "restart it with `vllm serve … --logprobs-mode processed_logprobs`, or remove rollout `logprobs_mode` "
            "and set sampling_correction: none",
        )
    ]


def _rollout_sync_problems(stage, where: tuple, rollout) -> list[Problem]:
    root = server_root(rollout.server_url)
    unset = _unset_key(stage, where, f"vLLM rollout server {root}", rollout)
    if unset:
        return unset
    variable = rollout.api_key_env
    key = os.environ.get(variable) if variable else None
    if rollout.sync == "none":
        note_once(
            f"note: stage {stage.id!r} samples its rollouts from the vLLM server at {root} with the weights that server "
            "loaded: they do not follow the policy being trained (rollout `sync: none`). With a LoRA policy, "
            "`sync: adapter` loads each step's adapter into the server; `mode: colocate` takes the full weights."
        )
        served = _served(root, key) if key is not None else ()  # a keyless server is not asked: nothing to refuse
        answer: bool | Refused | Unreachable = served if isinstance(served, (Refused, Unreachable)) else True
    else:
        answer = _lora_api(root, key)
    said = _unasked_or_refused(stage, where, root, variable, answer)
    if said is not None:
        return said
    if answer:
        return []
    from alignpipe.engine.vllm import max_lora_rank

    rank = max_lora_rank(stage.lora.r) if stage.lora else 16
    return [
        Problem(
            (*where, "sync"),
            f"stage {stage.id!r} loads its LoRA adapter into the vLLM server at {root} before each rollout "
            "(`sync: adapter`), and that server has no runtime LoRA API (no /v1/load_lora_adapter route)",
            "restart it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in its environment and `vllm serve <the stage's "
            f"starting model> --enable-lora --max-lora-rank {rank}`",
        )
    ]


def _unasked_or_refused(
    stage, where: tuple, root: str, variable: str | None, answer: bool | Refused | Unreachable
) -> list[Problem] | None:
    """What a rollout server's answer to a check says where it is not the answer asked for: no answer (one note,
    the run goes on) or a refusal of the key (a problem); None where the server answered."""
    if isinstance(answer, Unreachable):
        note_once(
            f"note: the vLLM server at {root} could not be asked ({answer.why}), so stage {stage.id!r}'s rollouts "
            "were not checked against it; the stage will find out at its first rollout."
        )
        return []
    if isinstance(answer, Refused):
        return [
            Problem(
                (*where, "api_key_env" if variable else "server_url"),
                f"stage {stage.id!r}'s vLLM rollout server {root} refuses "
                f"{f'the key in {variable}' if variable else 'a request without an API key'} (HTTP {answer.status})",
                f"put the key the server was started with (`vllm serve --api-key`) in {variable}"
                if variable
                else "set rollout `api_key_env:` to the environment variable holding the server's `--api-key`",
            )
        ]
    return None


@functools.cache
def _lora_api(root: str, api_key: str | None) -> bool | Refused | Unreachable:
    """Whether the server mounts vLLM's runtime LoRA routes: asked by unloading a name no one loaded (vLLM answers
    that it holds no such adapter; a server without the routes answers FastAPI's plain 404)."""
    import uuid

    import httpx

    from alignpipe.engine.vllm import route_missing

    try:
        response = httpx.post(
            f"{root}/v1/unload_lora_adapter",
            json={"lora_name": f"alignpipe-probe-{uuid.uuid4().hex[:8]}"},
            headers=auth_headers(api_key),
            timeout=TIMEOUT_S,
        )
    except Exception as e:  # no connection, a timeout, no DNS
        return unreachable(e)
    if response.status_code in (401, 403):
        return Refused(response.status_code)
    return not (response.status_code == 404 and route_missing(response))


PROBE_PROMPT = "The weather today is"
PROBE_TEMPERATURES = (1.0, 0.25)


@functools.cache
def _follows_temperature(root: str, api_key: str | None) -> bool | Refused | Unreachable:
    """Whether the server's log-probs are its sampler's (`--logprobs-mode processed_logprobs`): the 5 best
    log-probs of one token of the model it serves first, asked at temperature 1 and at 0.25. The raw model's are the
    same at both; the sampler's sharpen at 0.25 (the best rises, the others fall)."""
    import httpx

    served = _served(root, api_key)
    if isinstance(served, (Refused, Unreachable)):
        return served
    if not served:
        return Unreachable("no model listed at /v1/models")
    best = []
    for temperature in PROBE_TEMPERATURES:
        body = {
            "model": served[0],
            "prompt": PROBE_PROMPT,
            "max_tokens": 1,
            "temperature": temperature,
            "logprobs": 5,
            "seed": 0,
        }
        try:
            response = httpx.post(f"{root}/v1/completions", json=body, headers=auth_headers(api_key), timeout=TIMEOUT_S)
            response.raise_for_status()
            top = response.json()["choices"][0]["logprobs"]["top_logprobs"][0]
            best.append(sorted((float(v) for v in top.values()), reverse=True))
        except Exception as e:  # no connection, a refusal, an answer without log-probs
            return unreachable(e)
    return any(abs(a - b) > 1e-3 for a, b in zip(*best))


def _judge_server_problems(stage, where: tuple, spec) -> list[Problem]:
    """What the judge server's /v1/models says against the key and `served_model`."""
    root, variable = server_root(spec.url), spec.api_key_env
    answer = _served(root, os.environ.get(variable) if variable else None)
    if isinstance(answer, Unreachable):
        note_once(
            f"note: the judge server {root} could not be asked which models it serves ({answer.why}), so stage "
            f"{stage.id!r}'s judge was not checked; the stage will find out when it runs."
        )
        return []
    if isinstance(answer, Refused):
        key = f"the key in {variable}" if variable else "a request without an API key"
        fix = (
            f"put a key this server accepts in {variable}"
            if variable
            else "set `api_key_env:` to the environment variable holding the server's API key (e.g. OPENAI_API_KEY)"
        )
        message = f"stage {stage.id!r}'s judge server {root} refuses {key} (HTTP {answer.status})"
        return [Problem((*where, "api_key_env" if variable else "url"), message, fix)]
    if spec.served_model is not None and spec.served_model not in answer:
        close = difflib.get_close_matches(spec.served_model, answer, n=3, cutoff=0.5)
        listed = ", ".join(close or answer[:SHOWN]) + (" …" if not close and len(answer) > SHOWN else "")
        message = (
            f"stage {stage.id!r}'s judge server {root} serves no model {spec.served_model!r} ({len(answer)} listed at "
            "/v1/models)"
        )
        fix = (
            f"set served_model to one it serves: {listed}" if answer else "start the server with the judge model loaded"
        )
        return [Problem((*where, "served_model"), message, fix)]
    if spec.served_model is None and not answer:
        message = f"stage {stage.id!r}'s judge server {root} lists no model at /v1/models"
        return [Problem((*where, "url"), message, "start it with the judge model loaded, or set `served_model:`")]
    return []


def _unset_key(stage, where: tuple, what: str, spec) -> list[Problem]:
    variable = spec.api_key_env
    if not variable or os.environ.get(variable):
        return []
    return [
        Problem(
            (*where, "api_key_env"),
            f"stage {stage.id!r}'s {what} needs the API key in {variable}, which is not set on this machine",
            f"export {variable}=<the key> before running, or run the stage on a work pool whose workers have it "
            "(`resources.pool`)",
        )
    ]


@functools.cache
def _served(root: str, api_key: str | None) -> tuple[str, ...] | Refused | Unreachable:
    """The ids a server lists at /v1/models, asked once a process (the CLI and the flow it starts both validate)."""
    import httpx

    try:
        response = httpx.get(f"{root}/v1/models", headers=auth_headers(api_key), timeout=TIMEOUT_S)
    except Exception as e:  # no connection, a timeout, no DNS
        return unreachable(e)
    if response.status_code in (401, 403):
        return Refused(response.status_code)
    try:
        response.raise_for_status()
        return tuple(str(m["id"]) for m in response.json().get("data") or [])
    except Exception as e:  # a 404 (a server without /v1/models), a 5xx, a proxy's page that is not the list
        return Unreachable(f"HTTP {response.status_code}" if response.is_error else unreachable(e).why)
