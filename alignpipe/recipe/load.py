"""Load a recipe: safe YAML → `--set` overrides → typed model → graph and data checks.

Every problem becomes a `Problem` with the recipe field path, the YAML line where known and a fix;
all of them are raised together as one `RecipeError`. Nothing is written while loading.
"""

from __future__ import annotations

import copy
import difflib
import functools
import json
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from alignpipe.recipe.check import check_recipe
from alignpipe.recipe.endpoints import endpoint_problems
from alignpipe.recipe.errors import Problem, RecipeError
from alignpipe.recipe.push_access import push_token_problems
from alignpipe.recipe.schema import Recipe
from alignpipe.recipe.stages import STAGE_KINDS
from alignpipe.recipe.tracking_server import tracking_problems


def load_recipe(
    path: str | Path, overrides: list[str] | tuple[str, ...] = (), check_files: bool = True, to_run: bool = False
) -> Recipe:
    """Read, override, validate and check a recipe file. Raises `RecipeError`. `to_run`: also what running it from
    this machine needs of the machine (an MLflow tracking server that answers, a Hub token that can write for a push
    that runs here, an endpoint judge's or remote scorer's key, a judge server's model: `validate`, `run` and the
    flow)."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError([Problem((), f"recipe file {str(path)!r} not found", "pass the path of a .yaml recipe")])
    return parse_recipe(path.read_text(), overrides, source=str(path), check_files=check_files, to_run=to_run)


def parse_recipe(
    text: str, overrides=(), source: str = "recipe", check_files: bool = True, to_run: bool = False
) -> Recipe:
    """Like `load_recipe`, from YAML text."""
    data, lines = _read_yaml(text, source)
    overridden: dict[tuple, str] = {}
    data = apply_overrides(data, overrides, source, overridden)
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as e:
        problems = [_problem_from_pydantic(dict(err), data, lines) for err in e.errors()]
        problems += _checks_past(problems, data, lines, check_files)
        raise RecipeError(_name_overrides(problems, overridden), source) from None
    problems = check_recipe(recipe, check_files=check_files)
    if to_run and not problems:
        problems = tracking_problems(recipe) + push_token_problems(recipe) + endpoint_problems(recipe)
    problems = _located(problems, data, lines)
    if problems:
        raise RecipeError(_name_overrides(problems, overridden), source)
    return recipe


def _located(problems: list[Problem], data: dict, lines: dict[tuple, int]) -> list[Problem]:
    for p in problems:
        p.line = p.line or _line_for(p.path, lines)
        p.label = p.label or _label_for(p.path, data)
    return problems


def _checks_past(
    field_problems: list[Problem], data: dict, lines: dict[tuple, int], check_files: bool
) -> list[Problem]:
    """The graph and data checks' problems of a recipe whose fields failed, so that one run lists both kinds where
    that is safe: where every field problem is a bad value (`_VALUE_ERRORS`), the checks run on a copy with those
    keys left out (their defaults in their place), and what they find in a stage or section that lost a key is not
    listed (a default the user did not write could be what a check there objects to). Otherwise (an unknown key,
    perhaps a misspelt `format:`; a wrong kind, reference or text) the checks wait for the next run, as before."""
    repaired = copy.deepcopy(data)
    for problem in field_problems:
        *parent, key = problem.path or (None,)
        holder = functools.reduce(_child, parent, repaired)
        if problem.kind not in _VALUE_ERRORS or not isinstance(holder, dict) or key not in holder:
            return []
        del holder[key]
    try:
        recipe = Recipe.model_validate(repaired)
    except ValidationError:
        return []
    touched = {_owner(p.path) for p in field_problems}
    found = check_recipe(recipe, check_files=check_files)
    return _located([p for p in found if _owner(p.path) not in touched], data, lines)


def _owner(path: tuple) -> tuple:
    """The stage (`stages[i]`) or top-level section a path lies in."""
    return tuple(path[:2]) if path[:1] == ("stages",) else tuple(path[:1])


def _name_overrides(problems: list[Problem], overridden: dict[tuple, str]) -> list[Problem]:
    """A problem at (or inside) a value a `--set` wrote names that override, not a line of the file."""
    for p in problems:
        for path, item in overridden.items():
            if tuple(p.path[: len(path)]) == path:
                p.override = item
    return problems


def _read_yaml(text: str, source: str) -> tuple[dict, dict[tuple, int]]:
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = mark.line + 1 if mark else None
        raise RecipeError(
            [
                Problem(
                    (),
                    f"not valid YAML: {getattr(e, 'problem', e)}",
                    "fix the YAML syntax (indentation, quotes, colons)",
                    line=line,
                )
            ],
            source,
        ) from None
    if not isinstance(data, dict):
        raise RecipeError(
            [
                Problem(
                    (),
                    "a recipe must be a YAML mapping (name:, model:, stages: ...)",
                    "see pipelines/tiny-demo.yaml for an example",
                )
            ],
            source,
        )
    lines: dict[tuple, int] = {}
    duplicates: list[Problem] = []
    _collect_lines(node, (), lines, duplicates)
    if duplicates:
        raise RecipeError(duplicates, source)
    return data, lines


def _collect_lines(node, path: tuple, out: dict[tuple, int], duplicates: list[Problem]) -> None:
    """Record the line of every key and item; a key given twice in one mapping (YAML would keep the last one
    silently) is a Problem."""
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            p = path + (key.value,)
            line = key.start_mark.line + 1
            if p in out and key.value != "<<":
                duplicates.append(
                    Problem(
                        p,
                        f"key {key.value!r} is given twice (lines {out[p]} and {line}); YAML would keep only the last",
                        "remove one of them",
                        line=line,
                    )
                )
            out[p] = line
            _collect_lines(value, p, out, duplicates)
    elif isinstance(node, yaml.SequenceNode):
        for i, value in enumerate(node.value):
            p = path + (i,)
            out[p] = value.start_mark.line + 1
            _collect_lines(value, p, out, duplicates)


def _line_for(path: tuple, lines: dict[tuple, int]) -> int | None:
    for n in range(len(path), 0, -1):  # nearest ancestor that is in the file
        if path[:n] in lines:
            return lines[path[:n]]
    return None


def _label_for(path: tuple, data: dict) -> str:
    if len(path) >= 2 and path[0] == "stages" and isinstance(path[1], int):
        try:
            return f"stage {data['stages'][path[1]]['id']!r}"
        except (KeyError, IndexError, TypeError):
            return ""
    return ""


# --- `--set` overrides -------------------------------------------------------------------------


def apply_overrides(data: dict, overrides, source: str = "recipe", applied: dict | None = None) -> dict:
    """Apply `a.b.c=value` overrides. In `stages.X.field`, X is a stage id or an index. Values are
    parsed as YAML (`3e-4` → float, `[a, b]` → list, `null` → None). `applied` collects each override's resolved
    path (`("stages", 2, "max_steps")`) → the override."""
    problems = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            problems.append(
                Problem((), f"override {item!r} is not KEY=VALUE", "write e.g. --set stages.sft.max_steps=50")
            )
            continue
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError:
            value = raw
        err = _set_path(data, key.split("."), value)
        if not err and applied is not None:
            applied[_resolved(data, key.split("."))] = item
        if err:
            problems.append(
                Problem(
                    tuple(key.split(".")),
                    f"override --set {item!r}: {err}",
                    "use dotted field names; stages are addressed by id, e.g. stages.sft.learning_rate=1e-4",
                )
            )
    if problems:
        raise RecipeError(problems, source)
    return data


def _set_path(data: Any, parts: list[str], value: Any) -> str | None:
    node = data
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):
            idx = _list_index(node, part)
            if idx is None:
                ids = [s.get("id") for s in node if isinstance(s, dict)]
                return f"no list item {part!r} (ids: {', '.join(map(str, ids))})"
            if last:
                node[idx] = value
            else:
                node = node[idx]
        elif isinstance(node, dict):
            if last:
                node[part] = value
            else:
                node = node.setdefault(part, {})
        else:
            return f"{'.'.join(parts[:i])} is not a mapping"
    return None


def _resolved(data: Any, parts: list[str]) -> tuple:
    """The override path with list items (stages by id) as their indices, as validation errors locate them."""
    node: Any = data
    out: list[Any] = []
    for part in parts:
        if isinstance(node, list):
            idx = _list_index(node, part)
            out.append(idx)
            node = node[idx] if idx is not None else None
        else:
            out.append(part)
            node = node.get(part) if isinstance(node, dict) else None
    return tuple(out)


def _list_index(items: list, part: str) -> int | None:
    for i, item in enumerate(items):
        if isinstance(item, dict) and item.get("id") == part:
            return i
    if part.lstrip("-").isdigit() and -len(items) <= int(part) < len(items):
        return int(part) % len(items)
    return None


# --- pydantic errors → Problems ----------------------------------------------------------------


def _problem_from_pydantic(err: dict, data: dict, lines: dict[tuple, int]) -> Problem:
    loc = tuple(err["loc"])
    # Discriminated unions insert the tag into the location: stages[1].sft.lr → stages[1].lr
    if len(loc) >= 3 and loc[0] == "stages" and isinstance(loc[1], int) and loc[2] in STAGE_KINDS:
        loc = loc[:2] + loc[3:]
    kind = err["type"]
    msg, hint = err["msg"], ""
    model = _model_at(loc[:-1], data)
    secret = _may_hold_a_secret(model, loc[-1] if loc else None)
    if kind == "extra_forbidden":
        key = loc[-1]
        allowed = sorted(model.model_fields) if model else []
        close = difflib.get_close_matches(str(key), allowed, n=1)
        msg = f"unknown key {key!r}"
        hint = f"did you mean {close[0]!r}? " if close else ""
        hint += f"allowed keys here: {', '.join(allowed)}" if allowed else "remove it"
    elif kind == "missing":
        field = loc[-1]
        msg = f"required key {field!r} is missing"
        desc = _describe(model, field)
        hint = f"add `{field}:` ({desc})" if desc else f"add `{field}:`"
    elif kind == "union_tag_invalid":
        found = err.get("ctx", {}).get("tag")
        msg = f"unknown stage kind {found!r}"
        hint = f"use one of: {', '.join(STAGE_KINDS)}"
    elif kind == "union_tag_not_found":
        msg = "stage has no `kind`"
        hint = f"add `kind:` with one of: {', '.join(STAGE_KINDS)}"
    elif kind in _BOUNDS and loc:
        field, (word, key) = loc[-1], _BOUNDS[kind]
        msg = f"{field} must be {word} {err['ctx'][key]} (got {err.get('input')!r})"
        default = _default(model, field)
        hint = f"write `{field}:` as a number {word} {err['ctx'][key]}"
        hint += f" (default {default})" if default is not None else ""
        desc = _describe(model, field)
        hint += f"; the field is: {desc}" if desc else ""
    elif _expected(kind, err) and loc:
        field = loc[-1]
        got = err.get("input")
        msg = f"{field} must be {_expected(kind, err)} (got {got!r})"
        default = _default(model, field)
        hint = f"write `{field}:` as {_expected(kind, err)}"
        hint += f", e.g. `{field}: {json.dumps(default)}` (the default)" if default not in (None, [], {}) else ""
        desc = _describe(model, field)
        hint += f"; the field is: {desc}" if desc else ""
    else:
        if kind == "value_error":
            msg = msg.removeprefix("Value error, ")
        desc = _describe(model, loc[-1]) if loc else ""
        got = err.get("input")
        if not isinstance(got, (dict, list)) and not secret:
            msg = f"{msg} (got {got!r})"
        if desc:
            hint = f"this field is: {desc}"
    return Problem(loc, msg, hint, line=_line_for(loc, lines), label=_label_for(loc, data), kind=kind, secret=secret)


_TYPES = {
    "int_parsing": "a whole number",
    "int_type": "a whole number",
    "int_from_float": "a whole number",
    "float_parsing": "a number",
    "float_type": "a number",
    "bool_parsing": "true or false",
    "bool_type": "true or false",
    "string_type": "text (quote it if YAML reads it as something else)",
    "list_type": "a list, e.g. [a, b]",
    "dict_type": "a mapping, e.g. {key: value}",
    "model_type": "a mapping, e.g. {key: value}",
}


def _expected(kind: str, err: dict) -> str:
    """What a wrong-type value should have been, in recipe words."""
    if kind == "literal_error":
        return "one of " + str(err.get("ctx", {}).get("expected", "the listed values"))
    return _TYPES.get(kind, "")


_BOUNDS = {
    "greater_than": ("greater than", "gt"),
    "greater_than_equal": ("at least", "ge"),
    "less_than": ("less than", "lt"),
    "less_than_equal": ("at most", "le"),
}

# Field errors of a value alone (a number out of range, a number or a switch of the wrong type): leaving such a key
# out changes no stage's kind, data format or references, which the graph and data checks read (`_checks_past`).
_VALUE_ERRORS = {
    *_BOUNDS,
    *("int_parsing", "int_type", "int_from_float", "float_parsing", "float_type", "bool_parsing", "bool_type"),
}


def _default(model: type[BaseModel] | None, field):
    info = getattr(model, "model_fields", {}).get(field) if model is not None else None
    return None if info is None or info.is_required() else info.default


def _describe(model: type[BaseModel] | None, field) -> str:
    if model is None or field not in getattr(model, "model_fields", {}):
        return ""
    text = " ".join((model.model_fields[field].description or "").split())
    # the first sentence (docstrings wrap mid-sentence); "e.g. " and "i.e. " do not end one
    first = re.split(r"(?<!e\.g)(?<!i\.e)(?<=[a-z0-9)`])\. ", text, maxsplit=1)[0]
    return first if first.endswith(".") else first + "."


def _may_hold_a_secret(model: type[BaseModel] | None, field) -> bool:
    """A field whose wrong value may be a credential pasted in the wrong place (`api_key_env: sk-...`): its value is
    not repeated in the problem."""
    info = getattr(model, "model_fields", {}).get(field) if model is not None else None
    extra = info.json_schema_extra if info is not None else None
    return isinstance(extra, dict) and bool(extra.get("may_hold_a_secret"))


def _model_at(path: tuple, data: dict) -> type[BaseModel] | None:
    """The pydantic model that validates the mapping at `path` (for listing its allowed keys)."""
    tp: Any = Recipe
    raw: Any = data
    for part in path:
        tp = _unwrap(tp, raw)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            field = tp.model_fields.get(part) if isinstance(part, str) else None
            tp = field.annotation if field else None
        elif typing.get_origin(tp) in (list, dict):
            tp = typing.get_args(tp)[-1]
        else:
            return None
        if tp is None:
            return None
        raw = _child(raw, part)
    tp = _unwrap(tp, raw)
    return tp if isinstance(tp, type) and issubclass(tp, BaseModel) else None


def _child(raw: Any, part) -> Any:
    if isinstance(raw, dict):
        return raw.get(part)
    if isinstance(raw, list) and isinstance(part, int) and part < len(raw):
        return raw[part]
    return None


def _unwrap(tp, raw):
    """Strip Optional/Annotated/Union; pick the stage class for a discriminated union from `kind`."""
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return _unwrap(typing.get_args(tp)[0], raw)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        if isinstance(raw, dict) and raw.get("kind") in STAGE_KINDS:
            return STAGE_KINDS[raw["kind"]]
        models = [a for a in options if isinstance(a, type) and issubclass(a, BaseModel)]
        if len(models) == 1:
            return models[0]
        return options[0] if len(options) == 1 else None
    return tp
