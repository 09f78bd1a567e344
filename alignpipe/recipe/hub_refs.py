"""The Hub repositories a recipe names, checked against the Hub before anything runs.

A misspelt id, a private repository the token cannot see, a gated one whose terms were not accepted, or a revision
that is not there would otherwise fail its stage only when the stage starts, after the stages before it have run (a
judge's Hub model at the end of a day's training). Only the repositories' metadata is asked for, nothing is
downloaded. The token is huggingface_hub's own (HF_TOKEN, else the cached login) and `HF_ENDPOINT` is respected.

Where the Hub cannot be asked (no network, a proxy, `HF_HUB_OFFLINE=1`), the ids are left to the stages: a machine
without the Hub may have them in its cache. The first then says once that they were not checked.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

from alignpipe.data.sources import is_hub_id, source_type
from alignpipe.recipe.errors import Problem

log = logging.getLogger("alignpipe.recipe")

TIMEOUT_S = 10.0
"""For each repository's metadata: a Hub that does not answer in this time is taken as unreachable."""


@dataclass(frozen=True)
class HubRef:
    where: tuple
    """The recipe field that names it (its revision's field is its sibling `revision`)."""
    repo_id: str
    repo_type: str  # "model" | "dataset"
    revision: str | None


def hub_refs(recipe) -> list[HubRef]:
    """Every Hub id the recipe names: the base model and its tokenizer, Hub datasets, and models judges name by id."""
    from alignpipe.recipe.stages import is_model_path

    refs = [
        HubRef(("model", field), value, "model", recipe.model.revision)
        for field in ("path", "tokenizer")
        if (value := getattr(recipe.model, field)) and is_hub_id(value)
    ]
    refs += [
        HubRef(("datasets", name, "path"), spec.path, "dataset", spec.revision)
        for name, spec in recipe.datasets.items()
        if source_type(spec.path, spec.type) == "hub"
    ]
    refs += [
        HubRef(("stages", i, *path), value, "model", None)
        for i, s in enumerate(recipe.stages)
        for path, value in s.named_models()
        if is_model_path(value) and is_hub_id(value)
    ]
    return refs


def check_hub_refs(recipe) -> list[Problem]:
    """A problem at each field naming a Hub id the Hub says is missing, out of reach of the token, or without the
    revision; each repository is asked once."""
    refs = hub_refs(recipe)
    if not refs:
        return []
    from huggingface_hub import constants

    if constants.is_offline_mode():  # HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE): the stages read the cache only
        return []

    problems: list[Problem] = []
    for ref in refs:
        verdict = _ask(constants.ENDPOINT, ref.repo_id, ref.repo_type, ref.revision)
        if isinstance(verdict, Unreachable):
            note_once(
                f"note: the Hub ({constants.ENDPOINT}) could not be asked about this recipe's Hub ids ({verdict.why}), "
                f"so they were not checked: {', '.join(dict.fromkeys(r.repo_id for r in refs))}. Their stages will "
                "load them from the Hub or this machine's cache when they start."
            )
            return problems
        if verdict is not None:
            field, message, hint = verdict
            problems.append(
                Problem(ref.where[:-1] + ("revision",) if field == "revision" else ref.where, message, hint)
            )
    return problems


@dataclass(frozen=True)
class Unreachable:
    why: str


@functools.cache
def _ask(
    endpoint: str, repo_id: str, repo_type: str, revision: str | None
) -> tuple[str, str, str] | Unreachable | None:
    """The Hub's verdict on one repository, asked once a process (the CLI and the flow it starts both validate):
    None when it is there and readable, (field, message, fix) when not, `Unreachable` when the Hub did not say."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    api = HfApi(endpoint=endpoint)
    what = f"{repo_type} {repo_id!r}"
    page = f"{endpoint}/{'datasets/' if repo_type == 'dataset' else ''}{repo_id}"
    try:
        info = api.repo_info(repo_id, repo_type=repo_type, revision=revision, timeout=TIMEOUT_S)
        if getattr(info, "gated", False):
            api.auth_check(repo_id, repo_type=repo_type)
    except GatedRepoError:
        return (
            "",
            f"{what} is gated on the Hub, and the token here has not been granted access",
            f"accept its terms at {page} with your account, then set HF_TOKEN to a token of that account",
        )
    except RevisionNotFoundError:
        return (
            "revision",
            f"{what} has no revision {revision!r} on the Hub",
            f"use a branch, tag or commit of {page}, or remove `revision` for its main branch",
        )
    except RepositoryNotFoundError:
        return (
            "",
            f"no {what} on the Hub that the token here can see (misspelt, or private)",
            f"check the id at {page} (org/name, case included); for a private repository set HF_TOKEN to a token "
            "that can read it; or give a local path",
        )
    except HfHubHTTPError as e:  # the Hub answered, but not about the repository (a 5xx, a proxy's page)
        status = e.response.status_code if e.response is not None else "?"
        return Unreachable(f"it answered HTTP {status}")
    except Exception as e:  # no connection, a timeout, no DNS: whatever the client raised before an answer
        return unreachable(e)
    return None


def unreachable(error: Exception) -> Unreachable:
    """What the client raised before the Hub answered, in one line."""
    first = str(error).splitlines()[0] if str(error) else ""
    return Unreachable(f"{type(error).__name__}: {first}".rstrip(": "))


@functools.cache
def note_once(text: str) -> None:
    """Logged once a process: the CLI and the flow it starts both validate."""
    log.warning("%s", text)
