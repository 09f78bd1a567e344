"""What the HTTP endpoints stages call (an endpoint judge, a remote scorer) share: the API key, held in an environment
variable the recipe names (`api_key_env`), read where the stage runs and sent in the `Authorization` header only
(never the recipe, a log, an error or MLflow); and the retries of a call.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from typing import Any


def endpoint_api_key(variable: str | None, field: str) -> str | None:
    """The key in environment variable `variable` (the recipe's `field`), or None without one."""
    if variable is None:
        return None
    key = os.environ.get(variable)
    if not key:
        raise ValueError(
            f"{field} names {variable}, which is not set where this stage runs: export the endpoint's API key in it "
            "(on a work pool, in its workers' environment)"
        )
    return key


def variable_name(v: str | None) -> str | None:
    """An `api_key_env` field's check: an environment variable's name. A value that is not one is not repeated: it
    may be the key."""
    if v is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", v):
        raise ValueError(
            "api_key_env is the name of an environment variable (letters, digits, _; e.g. OPENAI_API_KEY), not "
            "the key: export the key in that variable where the stage runs"
        )
    return v


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def answer_with_retries(send: Callable[[], Any], retries: int) -> tuple[Any, int]:
    """`send()`'s answer and the attempts it took, asked up to `retries` times while it is a timeout, a connection
    error, a 5xx or a 429 (rate limited), backing off 1, 2, 4 s, or as long as a 429's Retry-After asks (up to a
    minute). The answer is the first one of any other kind (a success, or a 4xx that asking again will not help), else
    the last attempt's: an HTTP response, or the `httpx.TransportError` raised by the last attempt (returned, not
    raised, so that each caller words its own error)."""
    import httpx

    for attempt in range(1, retries + 1):
        try:
            response = send()
        except httpx.TransportError as e:
            if attempt == retries:
                return e, attempt
            time.sleep(2 ** (attempt - 1))
            continue
        retried = response.status_code >= 500 or response.status_code == 429
        if not retried or attempt == retries:
            return response, attempt
        time.sleep(retry_after(response) if response.status_code == 429 else 2 ** (attempt - 1))
    raise ValueError(f"retries is at least 1, not {retries}")


def json_with_retries(
    send: Callable[[], Any],
    what: str,
    retries: int,
    timeout_s: float,
    error=RuntimeError,
    quote: bool = False,
    key: str | None = None,
) -> Any:
    """`send()`'s JSON answer, asked as `answer_with_retries` does; a failure raises `error` naming `what`, the
    cause and the attempts. `quote`: the error also gives the server's own message (its error's `message`, FastAPI's
    `detail`, or the text), with the `key` sent masked wherever the server repeats it."""
    import httpx

    answer, attempts = answer_with_retries(send, retries)
    try:
        if isinstance(answer, httpx.TransportError):
            raise answer
        answer.raise_for_status()
        return answer.json()
    except (httpx.TransportError, httpx.HTTPStatusError) as e:
        answered = e.response if isinstance(e, httpx.HTTPStatusError) else None
        said = f"; the server said: {server_message(answered, key)}" if quote and answered is not None else ""
        first = str(e).splitlines()[0] if str(e) else ""
        raise error(
            f"{what}: {type(e).__name__}: {first}{said} (after {attempts} attempt(s), {timeout_s:g} s timeout each)"
        ) from e


def retry_after(response) -> float:
    """A 429's wait: its Retry-After seconds (capped at a minute), else 1 s."""
    try:
        return min(60.0, max(0.0, float(response.headers.get("retry-after", 1))))
    except ValueError:  # an HTTP date: rare from these APIs
        return 1.0


def server_message(response, key: str | None = None) -> str:
    """What an HTTP error answer says, in one line: an OpenAI-style `error.message`, vLLM's `message`, FastAPI's
    `detail`, else the start of its text; `key` masked wherever it is repeated."""
    try:
        body = response.json()
    except ValueError:
        body = None
    text = response.text
    if isinstance(body, dict):
        inner = body.get("error")
        said = [inner.get("message") if isinstance(inner, dict) else inner, body.get("message"), body.get("detail")]
        text = next((x for x in said if isinstance(x, str) and x), text)
    if key:
        text = text.replace(key, "***")
    return " ".join(text.split())[:500]
