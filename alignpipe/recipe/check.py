"""Checks a typed recipe can't express: the stage graph, references, the data on disk and the Hub ids."""

from __future__ import annotations

import difflib
from pathlib import Path

from alignpipe.data.sources import is_hub_id, peek_columns, source_type
from alignpipe.positions import config_position_limit, local_config, stage_window, window_problem
from alignpipe.recipe.errors import Problem
from alignpipe.recipe.hub_refs import check_hub_refs
from alignpipe.recipe.stages import (
    BASE,
    CAUSAL_LM,
    DATASET,
    REWARD_MODEL,
    DPOStage,
    FormatStage,
    GRPOStage,
    JudgeStage,
    KTOStage,
    OnlineDPOStage,
    PPOStage,
    RewardStage,
    RLOOStage,
    SFTStage,
)

# Canonical columns each format needs from the source (after `columns` mapping); any one option.
REQUIRED_COLUMNS: dict[str, list[tuple[str, ...]]] = {
    "language_modeling": [("text",), ("messages",)],
    "prompt_completion": [("prompt", "completion"), ("messages",)],
    "prompt_only": [("prompt",), ("messages",)],
    "preference": [("prompt", "chosen", "rejected"), ("chosen", "rejected")],
    "unpaired": [("prompt", "completion", "label"), ("prompt", "chosen", "rejected"), ("chosen", "rejected")],
}
# Formats a consuming stage accepts from its `data`/`prompts` format stage.
ACCEPTED_FORMATS = {
    (SFTStage, "data"): ("language_modeling", "prompt_completion"),
    (JudgeStage, "prompts"): ("prompt_completion", "prompt_only", "preference"),
    (RewardStage, "data"): ("preference",),
    (DPOStage, "data"): ("preference",),
    (KTOStage, "data"): ("unpaired",),
    (GRPOStage, "data"): ("prompt_only", "prompt_completion", "preference"),
    (RLOOStage, "data"): ("prompt_only", "prompt_completion", "preference"),
    (PPOStage, "data"): ("prompt_only", "prompt_completion", "preference"),
    (OnlineDPOStage, "data"): ("prompt_only", "prompt_completion", "preference"),
}
PRODUCT_NAMES = {CAUSAL_LM: "a causal LM", DATASET: "a dataset", REWARD_MODEL: "a reward model"}


def check_recipe(recipe, check_files: bool = True) -> list[Problem]:
    problems = _check_ids(recipe)
    if problems:
        return problems  # graph checks below assume unique ids
    problems += _check_needs_and_refs(recipe)
    if not problems:
        problems += _check_cycles(recipe)
    problems += _check_storage(recipe)
    if check_files:
        problems += _check_model(recipe)
        problems += _check_position_windows(recipe)
        problems += _check_router_loss(recipe)
        problems += _check_datasets(recipe)
        if not problems:  # the Hub is asked only about an otherwise valid recipe
            problems += check_hub_refs(recipe)
    return problems


def _check_assistant_only(s, i: int, by_id: dict) -> list[Problem]:
    """`assistant_only_loss` reads the reply spans a `language_modeling` format stage records for conversations."""
    data = by_id.get(getattr(s, "data", None))
    if not (isinstance(s, SFTStage) and s.assistant_only_loss and isinstance(data, FormatStage)):
        return []
    if data.format == "language_modeling":
        return []
    return [
        Problem(
            ("stages", i, "assistant_only_loss"),
            f"assistant_only_loss trains on the assistant replies of whole conversations, but format stage "
            f"{data.id!r} produces {data.format} data",
            f"set `format: language_modeling` on stage {data.id!r} (its dataset needs a `messages` column), or drop "
            "assistant_only_loss (prompt_completion data trains on its completions with completion_only_loss)",
        )
    ]


TOOL_FIELDS: dict[type, str] = {PPOStage: "data", OnlineDPOStage: "data"}
"""Stages that generate from a format stage's prompts but run no tool calls."""


def _check_tool_users(s, i: int, by_id: dict) -> list[Problem]:
    """Prompts that offer tools go to a stage that runs the calls (grpo, rloo, judge), or to offline training."""
    field = TOOL_FIELDS.get(type(s))
    data = by_id.get(getattr(s, field, None)) if field else None
    if not (isinstance(data, FormatStage) and data.tools):
        return []
    return [
        Problem(
            ("stages", i, field),
            f"format stage {data.id!r} offers tools in its prompts, but a {s.kind} stage does not run tool calls: "
            "the model's calls would go unanswered",
            f"use a grpo or rloo stage, or a format stage without `tools` for stage {s.id!r}",
        )
    ]


def _check_ids(recipe) -> list[Problem]:
    problems: list[Problem] = []
    seen: dict[str, int] = {}
    for i, s in enumerate(recipe.stages):
        if s.id == BASE:
            problems.append(
                Problem(("stages", i, "id"), "'base' is reserved for the recipe's model", "rename the stage")
            )
        elif s.id in seen:
            problems.append(
                Problem(
                    ("stages", i, "id"),
                    f"duplicate stage id {s.id!r} (also stages[{seen[s.id]}])",
                    "give every stage a unique id",
                )
            )
        seen.setdefault(s.id, i)
    return problems


def _check_needs_and_refs(recipe) -> list[Problem]:
    problems = []
    by_id = {s.id: s for s in recipe.stages}
    ids = ", ".join(by_id)
    for i, s in enumerate(recipe.stages):
        for j, need in enumerate(s.needs):
            if need == s.id:
                problems.append(
                    Problem(("stages", i, "needs", j), f"stage {s.id!r} needs itself", "remove it from `needs`")
                )
            elif need not in by_id:
                problems.append(Problem(("stages", i, "needs", j), f"no stage named {need!r}", f"name one of: {ids}"))
        for rel, target, wanted in s.reference_fields():
            path = ("stages", i, *rel)
            field = ".".join(map(str, rel))
            producers = [BASE] if wanted == CAUSAL_LM else []
            producers += [o.id for o in recipe.stages if o.produces == wanted and o.id != s.id]
            if target == BASE and wanted == CAUSAL_LM:
                continue
            if target == s.id:
                problems.append(
                    Problem(
                        path, f"stage {s.id!r} refers to itself", f"name one of: {', '.join(producers) or '(none yet)'}"
                    )
                )
            elif target not in by_id:
                problems.append(
                    Problem(
                        path,
                        f"no stage named {target!r}",
                        f"`{field}` takes {PRODUCT_NAMES.get(wanted, wanted)}: {', '.join(producers) or '(none in this recipe)'}",
                    )
                )
            elif by_id[target].produces != wanted:
                other = by_id[target]
                problems.append(
                    Problem(
                        path,
                        f"stage {target!r} is a {other.kind} stage and produces {PRODUCT_NAMES.get(other.produces, other.produces)}, "
                        f"but `{field}` needs {PRODUCT_NAMES.get(wanted, wanted)}",
                        f"name one of: {', '.join(producers) or '(none in this recipe)'}",
                    )
                )
            else:
                accepted = ACCEPTED_FORMATS.get((type(s), field))  # type: ignore[arg-type]
                if accepted and isinstance(by_id[target], FormatStage) and by_id[target].format not in accepted:
                    problems.append(
                        Problem(
                            path,
                            f"format stage {target!r} produces {by_id[target].format} data; a {s.kind} stage's `{field}` needs {' or '.join(accepted)}",
                            f"set `format:` of stage {target!r} to {accepted[0]}, or point `{field}` at another format stage",
                        )
                    )
        for target in sorted(s.gate_stages()):
            if target not in by_id:
                problems.append(
                    Problem(
                        ("stages", i, "when"),
                        f"the condition reads stage {target!r}, which does not exist",
                        f"name one of: {ids}",
                    )
                )
        problems += _check_gate_metrics(s, i, by_id)
        problems += _check_generation_groups(s, i)
        problems += _check_strategy(s, i)
        problems += _check_devices(s, i)
        problems += _check_assistant_only(s, i, by_id)
        problems += _check_tool_users(s, i, by_id)
        if isinstance(s, JudgeStage) and s.prompts_file and not Path(s.prompts_file).expanduser().exists():
            problems.append(
                Problem(
                    ("stages", i, "prompts_file"),
                    f"prompts file {s.prompts_file!r} does not exist",
                    "fix the path (relative paths are from the directory you run alignpipe in)",
                )
            )
        if isinstance(s, FormatStage):
            mixed = not isinstance(s.dataset, str)
            problems += [
                Problem(
                    ("stages", i, "dataset", *((j,) if mixed else ())),
                    f"no dataset named {name!r}",
                    f"add it under `datasets:` or name one of: {', '.join(recipe.datasets) or '(none defined)'}",
                )
                for j, name in enumerate(s.dataset_names)
                if name not in recipe.datasets
            ]
    return problems


def _check_gate_metrics(s, i: int, by_id: dict) -> list[Problem]:
    """A `when:` reference to a metric a judge stage never reports would fail only once that stage has run; a
    judge's metrics are known from the recipe (`JudgeStage.reports_metric`). Training stages' metrics depend on
    their settings (eval split, logging) and are looked up when the gate runs."""
    problems = []
    for stage, metric in s.gate_refs():
        judge = by_id.get(stage)
        if not isinstance(judge, JudgeStage) or judge.reports_metric(metric):
            continue
        names = [m for m in (*judge.RATES, *judge.COUNTS, *judge.SCORES, *judge.JUDGED) if judge.reports_metric(m)]
        near = difflib.get_close_matches(metric.removeprefix("judge/"), names, n=1)
        guess = f"; did you mean {near[0]!r}?" if near else ""
        pairs = ", ".join(f"{c}_vs_{b}/win_rate" for c, b in judge.pairs)
        problems.append(
            Problem(
                ("stages", i, "when"),
                f"judge stage {stage!r} reports no metric {metric!r}{guess}",
                f"name one it reports: {', '.join(names)} (of its first pair), or a pair's rate: {pairs} (or "
                "/ci_low, /ci_high)",
            )
        )
    return problems


# Stages whose training is tested sharded: the offline trainers (the online ones generate with the policy).
FSDP_KINDS = (SFTStage, RewardStage, DPOStage, KTOStage)


def _check_strategy(s, i: int) -> list[Problem]:
    """`strategy: fsdp` shards over processes: it needs two or more, an offline trainer, and no LoRA adapter."""
    if s.resources.strategy != "fsdp":
        return []
    where = ("stages", i, "resources", "strategy")
    if not isinstance(s, FSDP_KINDS):
        return [
            Problem(
                where,
                f"strategy: fsdp is supported for sft, reward, dpo and kto stages, not {s.kind} (its policy also "
                "generates, which is not tested sharded)",
                "remove `strategy` (DDP), or use a vLLM engine for generation-heavy stages on big models",
            )
        ]
    if s.resources.processes < 2 and not s.resources.accelerate_config:
        return [
            Problem(
                where,
                "strategy: fsdp shards the model across processes, but resources.processes is 1",
                "set resources.processes to the number of devices (e.g. 8), or remove `strategy`",
            )
        ]
    if getattr(s, "lora", None):
        return [
            Problem(
                where,
                "strategy: fsdp with a LoRA adapter is not supported (the adapter is small: DDP is the right choice)",
                "remove `strategy` (DDP), or train without `lora`",
            )
        ]
    return []


def _check_devices(s, i: int) -> list[Problem]:
    """Data-parallel ranks each take a GPU of their own (rank r on `cuda:r`): more processes than the GPUs the
    stage asks for would fail at launch, after the stages before it have run."""
    r = s.resources
    if not r.gpus or r.processes <= r.gpus or r.accelerate_config:
        return []
    return [
        Problem(
            ("stages", i, "resources", "processes"),
            f"processes: {r.processes} data-parallel ranks need a GPU each, but the stage asks for gpus: {r.gpus}",
            f"set gpus: {r.processes} (or more), or processes: {r.gpus}",
        )
    ]


def _check_generation_groups(s, i: int) -> list[Problem]:
    """GRPO's and RLOO's completions per step must split into whole groups of `num_generations`."""
    if not isinstance(s, GRPOStage | RLOOStage):
        return []
    per_step = s.batch_size * s.resources.processes
    if per_step % s.num_generations == 0 and s.batch_size % s.num_generations == 0:
        return []
    g = s.num_generations
    return [
        Problem(
            ("stages", i, "batch_size"),
            f"batch_size × processes = {s.batch_size} × {s.resources.processes} = {per_step} completions per forward "
            f"pass, which does not split into groups of num_generations = {g}",
            f"make batch_size a multiple of {g} (e.g. {g * max(1, round(s.batch_size / g))}), or change num_generations "
            f"to a divisor of {s.batch_size}",
        )
    ]


def _check_cycles(recipe) -> list[Problem]:
    deps = {s.id: s.dependencies() for s in recipe.stages}
    index = {s.id: i for i, s in enumerate(recipe.stages)}
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done

    def visit(node: str, stack: list[str]) -> list[str] | None:
        state[node] = 1
        for d in deps[node]:
            if state.get(d) == 1:
                return stack[stack.index(d) :] + [d] if d in stack else [node, d]
            if d not in state:
                cycle = visit(d, stack + [d])
                if cycle:
                    return cycle
        state[node] = 2
        return None

    for s in recipe.stages:
        if s.id not in state:
            cycle = visit(s.id, [s.id])
            if cycle:
                return [
                    Problem(
                        ("stages", index[cycle[0]], "needs"),
                        f"dependency cycle: {' → '.join(cycle)}",
                        "remove one of these dependencies (in `needs` or a reference field)",
                    )
                ]
    return []


def _check_storage(recipe) -> list[Problem]:
    """The storage URL's filesystem must be known to fsspec and its library installed (s3fs, gcsfs...)."""
    if recipe.storage is None:
        return []
    import fsspec
    from fsspec.registry import known_implementations

    protocol = recipe.storage.url.split("://", 1)[0]
    try:
        fsspec.get_filesystem_class(protocol)
    except ValueError:
        return [
            Problem(
                ("storage", "url"),
                f"unknown storage protocol {protocol!r}",
                "use an fsspec URL such as s3://bucket/prefix, gs://bucket/prefix or file:///mnt/shared",
            )
        ]
    except ImportError:
        hint = known_implementations.get(protocol, {}).get("err", "")
        return [
            Problem(
                ("storage", "url"),
                f"the {protocol!r} filesystem's library is not installed",
                f"pip install 'alignpipe[{protocol}]' (or the package fsspec names: {hint})"
                if protocol == "s3"
                else f"install it: {hint or 'see fsspec known implementations'}",
            )
        ]
    return []


def _looks_local(path: str) -> bool:
    return (
        path.startswith((".", "/", "~"))
        or path.count("/") >= 2
        or Path(path).suffix.lower() in (".jsonl", ".json", ".csv", ".parquet")
    )


def _check_model(recipe) -> list[Problem]:
    problems = []
    for field in ("path", "tokenizer"):
        value = getattr(recipe.model, field)
        if value and not Path(value).expanduser().exists() and (_looks_local(value) or not is_hub_id(value)):
            problems.append(
                Problem(
                    ("model", field),
                    f"model directory {value!r} does not exist",
                    "fix the path, run `alignpipe make-tiny assets/tiny` for the demo assets, or give a Hub id like org/name",
                )
            )
    return problems


def _check_position_windows(recipe) -> list[Problem]:
    """Every trainer stage's token window against the base model's learned position table (GPT-2's 1024), read
    from its `config.json` where that is on disk; a stage's own model derives from the base."""
    config = local_config(recipe.model.path, recipe.model.revision)
    limit = config_position_limit(config) if config else None
    problems = []
    for i, s in enumerate(recipe.stages):
        window = stage_window(s)
        problem = window_problem(limit, window, recipe.model.path)
        if problem and window:
            problems.append(Problem(("stages", i, window[1].split(" + ")[0]), *problem))
    return problems


def _check_router_loss(recipe) -> list[Problem]:
    """`router_aux_loss_coef` against the base model's `config.json` where that is on disk (every stage that takes
    the option trains a causal LM derived from the base): a non-zero one on a dense model, and an MoE model's loss
    under `compile` (`alignpipe.moe.RouterLoss.of` refuses both when the stage starts)."""
    config = local_config(recipe.model.path, recipe.model.revision)
    if config is None:
        return []
    text = config.get("text_config") or config
    moe = "output_router_logits" in text
    problems = []
    for i, s in enumerate(recipe.stages):
        coef = getattr(s, "router_aux_loss_coef", None)
        if coef and not moe:
            problems.append(
                Problem(
                    ("stages", i, "router_aux_loss_coef"),
                    f"router_aux_loss_coef is {coef}, but {recipe.model.path} is not a Mixture-of-Experts model (its "
                    "config declares no router logits), so there is no load-balancing loss to weight",
                    "remove router_aux_loss_coef from the stage",
                )
            )
        weight = (text.get("router_aux_loss_coef") or 0.0) if coef is None else coef
        if moe and weight and getattr(s, "compile", False):
            problems.append(
                Problem(
                    ("stages", i, "compile"),
                    f"{recipe.model.path} is a Mixture-of-Experts model trained with its load-balancing loss "
                    f"(router_aux_loss_coef {weight}), which is recorded from its routers and cannot be under compile",
                    "set compile: false, or router_aux_loss_coef: 0 to train without the loss",
                )
            )
    return problems


def _check_datasets(recipe) -> list[Problem]:
    problems = []
    users: dict[str, list[tuple[int, FormatStage]]] = {}
    for i, s in enumerate(recipe.stages):
        if isinstance(s, FormatStage):
            for name in s.dataset_names:
                users.setdefault(name, []).append((i, s))
    for name, spec in recipe.datasets.items():
        kind = source_type(spec.path, spec.type)
        if kind == "hub":
            continue  # checked when the format stage loads it; no downloads at validation time
        if not Path(spec.path).expanduser().exists():
            problems.append(
                Problem(
                    ("datasets", name, "path"),
                    f"dataset file {spec.path!r} does not exist",
                    "fix the path (relative paths are from the directory you run alignpipe in), "
                    "or run `alignpipe make-tiny assets/tiny` for the demo data",
                )
            )
            continue
        try:
            cols = peek_columns(spec.path, kind)
        except Exception as e:  # unreadable file: say so here rather than mid-pipeline
            problems.append(
                Problem(
                    ("datasets", name, "path"),
                    f"cannot read {spec.path!r} as {kind}: {e}",
                    "check the file's contents or set `type:`",
                )
            )
            continue
        if cols is None:
            continue
        for canon, src in spec.columns.items():
            if src not in cols:
                problems.append(
                    Problem(
                        ("datasets", name, "columns", canon),
                        f"column {src!r} is not in {spec.path!r}",
                        f"columns found: {', '.join(cols)}",
                    )
                )
        available = {c for c in cols} | set(spec.columns)
        for _, stage in users.get(name, []):
            options = REQUIRED_COLUMNS[stage.format]
            if not any(all(c in available for c in opt) for opt in options):
                need = " or ".join("+".join(o) for o in options)
                problems.append(
                    Problem(
                        ("datasets", name, "columns"),
                        f"stage {stage.id!r} formats {name!r} as {stage.format}, which needs columns {need}; found: {', '.join(cols)}",
                        "map your columns, e.g. `columns: {"
                        + ", ".join(f"{c}: <your column>" for c in options[0])
                        + "}`",
                    )
                )
    return problems
