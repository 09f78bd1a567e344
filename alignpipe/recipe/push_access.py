"""Can a `push` stage that runs on this machine write where it pushes? Asked before the run, because the push is the
pipeline's last stage: a missing, expired or read-only token would otherwise fail it after the training.

The token is huggingface_hub's own (HF_TOKEN, else the saved login). The Hub's `whoami-v2` says whose it is, its role
(`read`, `write`, or `fineGrained` with per-namespace permissions) and the account's organisations. A push is refused
only where that answer shows it cannot succeed: the token is rejected, it is read-only, its account is not a member
of the repository's organisation (or only with the `read` role), or a fine-grained token grants no `repo.write` there.
Anything the answer does not settle (a `contributor` pushing to an organisation's repository someone else created, a
role this code does not know) is left to the push. A push with a Prefect Secret block (`token_secret`) reads its token
from the Prefect server, so the pipeline flow checks that one when it starts (`flows/preflight.py`, through
`hub_write_problems`); a push on a work pool without one gets its token where it runs and is not checked.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from alignpipe.recipe.errors import Problem
from alignpipe.recipe.hub_refs import TIMEOUT_S, Unreachable, note_once, unreachable

if TYPE_CHECKING:
    from alignpipe.recipe.stages import PushStage

TOKENS_PAGE = "/settings/tokens"
ENV_INSTALL = "export HF_TOKEN=<it> (or `hf auth login` again)"
"""How a new token replaces this machine's (the fixes' last words)."""


@dataclass(frozen=True)
class Account:
    """The parts of the Hub's `whoami-v2` answer that decide write access."""

    name: str
    token_name: str
    role: str  # "read" | "write" | "fineGrained" (another value decides nothing)
    org_roles: tuple[tuple[str, str], ...]  # (organisation, the account's role in it: read|contributor|write|admin)
    writable: frozenset[str]  # fine-grained: user/org names and repo ids whose scope grants `repo.write`


@dataclass(frozen=True)
class Rejected:
    """The Hub answered 401 to the token."""


def push_token_problems(recipe) -> list[Problem]:
    """A problem at each `push` to the Hub that runs here and could not write: no token on this machine, or (where
    the Hub can be asked) a token the Hub rejects or whose access does not reach the repository."""
    from alignpipe.recipe.stages import PushStage

    pushes = [
        (i, s)
        for i, s in enumerate(recipe.stages)
        if isinstance(s, PushStage) and s.target == "hub" and not s.token_secret and not s.resources.pool
    ]
    if not pushes:
        return []
    from huggingface_hub import get_token

    token = get_token()
    if not token:
        return [
            Problem(
                ("stages", i, "target"),
                f"stage {s.id!r} pushes to the Hub ({s.repo_id}), and this machine has no Hub token: HF_TOKEN is not "
                "set and no `hf auth login` token is saved",
                "export HF_TOKEN=<a token with write access> (https://huggingface.co/settings/tokens), or set "
                "`token_secret:` to a Prefect Secret block holding one, or `target: local`",
            )
            for i, s in pushes
        ]
    source = (
        "HF_TOKEN"
        if token in (os.environ.get("HF_TOKEN"), os.environ.get("HUGGING_FACE_HUB_TOKEN"))
        else "the saved `hf auth login` token"
    )
    return hub_write_problems(pushes, token, source)


def hub_write_problems(
    pushes: list[tuple[int, PushStage]],
    token: str,
    source: str,
    *,
    holder: str = "the token here",
    install: str = ENV_INSTALL,
    field: str = "repo_id",
) -> list[Problem]:
    """A problem at `stages[i].<field>` for each (i, push) that the Hub's answer about `token` shows cannot write;
    none where the Hub cannot be asked (one note says so) or this machine is offline. `source` names where the token
    comes from, `holder` what the messages call it, and `install` how a new token replaces it."""
    from huggingface_hub import constants

    if constants.is_offline_mode():
        return []
    endpoint = constants.ENDPOINT
    account = _whoami(endpoint, token)
    if isinstance(account, Unreachable):
        note_once(
            f"note: the Hub ({endpoint}) could not be asked whose {holder} is ({account.why}), so its write "
            f"access to {', '.join(sorted({str(s.repo_id) for _, s in pushes}))} was not checked; the push stage "
            "will find out when it runs."
        )
        return []
    problems = []
    for i, s in pushes:
        verdict = cannot_write(account, str(s.repo_id), source, endpoint, holder=holder, install=install)
        if verdict:
            message, fix = verdict
            problems.append(
                Problem(("stages", i, field), f"stage {s.id!r} pushes to {s.repo_id!r}, and {message}", fix)
            )
    return problems


def cannot_write(
    account: Account | Rejected,
    repo_id: str,
    source: str,
    endpoint: str,
    *,
    holder: str = "the token here",
    install: str = ENV_INSTALL,
) -> tuple[str, str] | None:
    """(why, fix) where the Hub's answer shows a push to `repo_id` will be refused; None where it may succeed."""
    tokens_page = endpoint + TOKENS_PAGE
    if isinstance(account, Rejected):
        return (
            f"the Hub rejects {holder} ({source}): expired, revoked or mistyped",
            f"create a token with write access at {tokens_page}, then {install}",
        )
    namespace = repo_id.split("/")[0] if "/" in repo_id else account.name
    token = f"{holder} ({source}, {account.token_name!r} of account {account.name!r})"
    if account.role == "read":
        return (
            f"{token} is read-only",
            f"create a token with write access at {tokens_page}, then {install}; or `target: local`",
        )
    if account.role == "fineGrained":
        if namespace in account.writable or repo_id in account.writable:
            return None
        return (
            f"{token} is fine-grained without write access to {namespace!r}'s repositories",
            f"at {tokens_page}, edit the token to grant write access to {namespace!r}'s repositories (or to "
            f"{repo_id}), or use a token with the write role",
        )
    if account.role != "write" or not account.name or namespace == account.name:
        return None
    orgs = dict(account.org_roles)
    if namespace not in orgs:
        where = ", ".join([account.name, *orgs])
        return (
            f"account {account.name!r} (whose token this is, {source}) is not a member of {namespace!r}",
            f"push under a namespace the account can write to ({where}), or ask an admin of {namespace!r} to add "
            f"{account.name!r} with the write role",
        )
    if orgs[namespace] == "read":
        return (
            f"account {account.name!r} (whose token this is, {source}) has the read role in {namespace!r}",
            f"ask an admin of {namespace!r} for the write (or contributor) role, or push under {account.name!r}",
        )
    return None


@functools.cache
def _whoami(endpoint: str, token: str) -> Account | Rejected | Unreachable:
    """The Hub's answer about the token, asked once a process (the endpoint is rate-limited, and the CLI and the flow
    it starts both validate). Not `HfApi.whoami`: that sets no timeout."""
    from huggingface_hub.errors import HfHubHTTPError
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    try:
        response = get_session().get(
            f"{endpoint}/api/whoami-v2", headers=build_hf_headers(token=token), timeout=TIMEOUT_S
        )
        hf_raise_for_status(response)
        answer = response.json()
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else None
        return Rejected() if status == 401 else Unreachable(f"it answered HTTP {status or '?'}")
    except Exception as e:  # no connection, a timeout, no DNS, a proxy's page that is not JSON
        return unreachable(e)
    return account_of(answer)


def account_of(answer: dict) -> Account:
    """`whoami-v2`'s JSON, read leniently: a missing part decides nothing rather than failing validation."""
    access = (answer.get("auth") or {}).get("accessToken") or {}
    fine = access.get("fineGrained") or {}
    scoped = fine.get("scoped") or []
    if "repo.write" in (fine.get("global") or []) and answer.get("name"):  # not seen in answers; not refused if sent
        scoped = [*scoped, {"entity": {"name": answer["name"]}, "permissions": ["repo.write"]}]
    return Account(
        name=str(answer.get("name") or ""),
        token_name=str(access.get("displayName") or "unnamed"),
        role=str(access.get("role") or ""),
        org_roles=tuple(
            (str(o.get("name")), str(o.get("roleInOrg") or "")) for o in answer.get("orgs") or [] if o.get("name")
        ),
        writable=frozenset(
            str((grant.get("entity") or {}).get("name"))
            for grant in scoped
            if "repo.write" in (grant.get("permissions") or []) and (grant.get("entity") or {}).get("name")
        ),
    )
