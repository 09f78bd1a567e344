"""`format` stage: raw dataset → canonical format, train/eval split, fingerprint."""

from __future__ import annotations

import logging
from pathlib import Path

from alignpipe.data.formats import ConversationError, LabelError, MissingColumnError, format_rows
from alignpipe.data.sources import load_raw, source_type
from alignpipe.recipe.check import REQUIRED_COLUMNS
from alignpipe.recipe.stages import FormatStage
from alignpipe.stages.context import StageContext, StageResult
from alignpipe.tool_calls import ToolError, check_template, load_tools, tool_schema

log = logging.getLogger(__name__)


def run(ctx: StageContext[FormatStage]) -> StageResult:
    import datasets

    s = ctx.stage
    spec = ctx.recipe.datasets[s.dataset]
    raw = load_raw(spec.path, spec.type, spec.split, spec.subset, spec.revision)
    cols = set(raw.column_names) | set(spec.columns)
    if not any(all(c in cols for c in opt) for opt in REQUIRED_COLUMNS[s.format]):
        need = " or ".join("+".join(o) for o in REQUIRED_COLUMNS[s.format])
        raise ValueError(
            f"dataset {s.dataset!r} has columns {sorted(raw.column_names)}; {s.format} needs {need}. "
            f"Map them in the recipe: datasets.{s.dataset}.columns"
        )
    tools = None
    if s.tools:
        try:
            tools = [tool_schema(fn, spec) for fn, spec in zip(load_tools(s.tools), s.tools, strict=True)]
            check_template(ctx.tokenizer(), s.chat_template_kwargs)
        except ToolError as e:
            raise ValueError(f"stage {s.id!r} (tools): {e}") from None
    try:
        train, evals, stats = format_rows(
            raw.to_list(),
            fmt=s.format,
            tokenizer=ctx.tokenizer(),
            columns=spec.columns,
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
    except LabelError as e:
        raise ValueError(
            f"stage {s.id!r} formats dataset {s.dataset!r} as unpaired, which needs a boolean `label` (true = a "
            f"desirable completion, false = an undesirable one), but {e}. Columns found: "
            f"{', '.join(raw.column_names)}. Map a true/false column in the recipe: "
            f"datasets.{s.dataset}.columns: {{label: <your column>}}; or give preference rows (prompt, chosen, "
            "rejected), which split into chosen → true and rejected → false"
        ) from None
    except MissingColumnError as e:
        raise ValueError(
            f"stage {s.id!r} formats dataset {s.dataset!r} as {s.format}, but {e}. Map the column in the recipe: "
            f"datasets.{s.dataset}.columns: {{{e.column}: <your column>}}"
        ) from None
    except ConversationError as e:
        raise ValueError(
            f"stage {s.id!r} formats dataset {s.dataset!r} as {s.format}: {e}. Drop such rows from the data, or "
            "use `format: prompt_only` (prompts only) or `language_modeling` (the whole conversation)"
        ) from None
    if stats.dropped_too_long:
        log.info("dropped %d rows longer than %d tokens", stats.dropped_too_long, s.max_length)
    if stats.dropped_identical_pair:
        log.info("dropped %d preference rows whose chosen == rejected", stats.dropped_identical_pair)
    log.info(
        "formatted %s → %s: %d train / %d eval rows (fingerprint %s)",
        s.dataset,
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
    ctx.tracker.log_params(
        {
            "format": s.model_dump(mode="json", exclude={"resources"}),
            "dataset": spec.model_dump(mode="json"),
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
            "dataset": s.dataset,
            "path": spec.path,
            "hub": source_type(spec.path, spec.type) == "hub",
        },
    )
