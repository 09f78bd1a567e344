"""`format` stage: raw dataset (or a mixture of several) → canonical format, train/eval split, fingerprint."""

from __future__ import annotations

import logging
import re
from pathlib import Path

from alignpipe.data.formats import LabelError, MissingColumnError, RowError, format_rows
from alignpipe.data.mixture import Source, mix
from alignpipe.data.sources import load_raw, source_type
from alignpipe.recipe.check import REQUIRED_COLUMNS
from alignpipe.recipe.stages import FormatStage
from alignpipe.stages.context import StageContext, StageResult
from alignpipe.tool_calls import ToolError, check_template, load_tools, tool_schema

log = logging.getLogger(__name__)


def run(ctx: StageContext[FormatStage]) -> StageResult:
    import datasets

    s = ctx.stage
    names = s.dataset_names
    specs = {name: ctx.recipe.datasets[name] for name in names}
    raws = {
        name: load_raw(spec.path, spec.type, spec.split, spec.subset, spec.revision) for name, spec in specs.items()
    }
    for name, raw in raws.items():
        cols = set(raw.column_names) | set(specs[name].columns)
        if not any(all(c in cols for c in opt) for opt in REQUIRED_COLUMNS[s.format]):
            need = " or ".join("+".join(o) for o in REQUIRED_COLUMNS[s.format])
            raise ValueError(
                f"dataset {name!r} has columns {sorted(raw.column_names)}; {s.format} needs {need}. "
                f"Map them in the recipe: datasets.{name}.columns"
            )
    tools = None
    if s.tools:
        try:
            tools = [tool_schema(fn, spec) for fn, spec in zip(load_tools(s.tools), s.tools, strict=True)]
            check_template(ctx.tokenizer(), s.chat_template_kwargs)
        except ToolError as e:
            raise ValueError(f"stage {s.id!r} (tools): {e}") from None
    if len(names) == 1:
        rows, columns = raws[names[0]].to_list(), specs[names[0]].columns
    else:
        rows, columns = _mixed(s, raws, specs, ctx.seed), {}
    try:
        train, evals, stats = format_rows(
            rows,
            fmt=s.format,
            tokenizer=ctx.tokenizer(),
            columns=columns,
            chat_template=s.chat_template,
            system_prompt=s.system_prompt,
            chat_template_kwargs=s.chat_template_kwargs,
            tools=tools,
            max_length=s.max_length,
            eval_fraction=s.eval_fraction,
            max_rows=s.max_rows,
            truncate_prompts=s.truncate_prompts,
            shuffle=s.shuffle,
            seed=ctx.seed,
        )
    except RowError as e:
        raise ValueError(_row_problem(s, e.source or names[0], raws, e)) from None
    if stats.dropped_too_long:
        log.info("dropped %d rows longer than %d tokens", stats.dropped_too_long, s.max_length)
    if stats.dropped_identical_pair:
        log.info("dropped %d preference rows whose chosen == rejected", stats.dropped_identical_pair)
    log.info(
        "formatted %s → %s: %d train / %d eval rows (fingerprint %s)",
        " + ".join(names),
        s.format,
        stats.rows_train,
        stats.rows_eval,
        stats.fingerprint,
    )
    out = Path(ctx.dir) / "data"
    empty: dict[str, list] = {k: [] for k in (train or evals or [{}])[0]}
    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(train) if train else datasets.Dataset.from_dict(empty),
            "eval": datasets.Dataset.from_list(evals) if evals else datasets.Dataset.from_dict(empty),
        }
    )
    # datasets writes no shard for an empty split unless told to, and then cannot load the dict back
    # (`eval_fraction: 0` leaves `eval` empty).
    dd.save_to_disk(str(out), num_shards={name: 1 for name, split in dd.items() if len(split) == 0} or None)
    metrics: dict[str, float] = {
        "rows_train": stats.rows_train,
        "rows_eval": stats.rows_eval,
        "dropped_too_long": stats.dropped_too_long,
        "dropped_identical_pair": stats.dropped_identical_pair,
    }
    mixed = len(names) > 1
    # each dataset's formatted rows, [train, eval] (a mixture's dataset none: every row of it was dropped)
    rows_of = {
        name: stats.rows_by_source.get(name, [0, 0]) if mixed else [stats.rows_train, stats.rows_eval] for name in names
    }
    if mixed:
        for name, (train_rows, eval_rows) in rows_of.items():
            metrics |= {f"rows_train/{_metric_name(name)}": train_rows, f"rows_eval/{_metric_name(name)}": eval_rows}
    dumps = {name: spec.model_dump(mode="json") for name, spec in specs.items()}
    ctx.tracker.log_params(
        {
            "format": s.model_dump(mode="json", exclude={"resources"}),
            "dataset": dumps if mixed else dumps[names[0]],
            "fingerprint": stats.fingerprint,
        }
    )
    ctx.tracker.log_metrics(metrics, 0)
    ctx.tracker.log_table(stats.examples, "examples")
    return StageResult(
        outputs={"data": str(out)},
        metrics=metrics,
        key_metric="rows_train",
        info={
            "fingerprint": stats.fingerprint,
            "format": s.format,
            "dataset": names if mixed else names[0],
            # each dataset read, for the model card's data table
            "sources": [
                {
                    "name": name,
                    "path": spec.path,
                    "hub": source_type(spec.path, spec.type) == "hub",
                    "rows": rows_of[name],
                }
                for name, spec in specs.items()
            ],
        },
    )


def _mixed(s: FormatStage, raws: dict, specs: dict, seed: int) -> list[dict]:
    """The mixture's rows (`mixture.mix`), what it took from each dataset logged, and the columns it dropped warned."""
    sources = [Source(name, raw.to_list(), specs[name].columns) for name, raw in raws.items()]
    mixture = mix(sources, s.dataset_weights, s.shuffle, seed)
    log.info(
        "mixing %s: %s",
        " + ".join(raws),
        ", ".join(f"{name} {mixture.taken[name]} of {len(raw)} rows" for name, raw in raws.items()),
    )
    for name, columns in mixture.dropped_columns.items():
        log.warning(
            "stage %r leaves out column(s) %s of dataset %r: not every dataset of the mixture has them (map them "
            "to the same name in each dataset's `columns` to keep them)",
            s.id,
            ", ".join(columns),
            name,
        )
    return mixture.rows


def _row_problem(s: FormatStage, name: str, raws: dict, e: RowError) -> str:
    """What is wrong with a row of dataset `name` and which mapping of the recipe would mend it."""
    if isinstance(e, LabelError):
        return (
            f"stage {s.id!r} formats dataset {name!r} as unpaired, which needs a boolean `label` (true = a "
            f"desirable completion, false = an undesirable one), but {e}. Columns found: "
            f"{', '.join(raws[name].column_names)}. Map a true/false column in the recipe: "
            f"datasets.{name}.columns: {{label: <your column>}}; or give preference rows (prompt, chosen, "
            "rejected), which split into chosen → true and rejected → false"
        )
    if isinstance(e, MissingColumnError):
        return (
            f"stage {s.id!r} formats dataset {name!r} as {s.format}, but {e}. Map the column in the recipe: "
            f"datasets.{name}.columns: {{{e.column}: <your column>}}"
        )
    return (
        f"stage {s.id!r} formats dataset {name!r} as {s.format}: {e}. Drop such rows from the data, or "
        "use `format: prompt_only` (prompts only) or `language_modeling` (the whole conversation)"
    )


def _metric_name(name: str) -> str:
    """A dataset's name as MLflow takes it in a metric's key."""
    return re.sub(r"[^\w./ :-]", "_", name)
