"""The end-of-run summary table and the DAG view (rich)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

STYLE = {"done": "green", "cached": "cyan", "failed": "bold red", "not run": "yellow", "skipped": "yellow"}
MESSAGE_CHARS = 160
"""A failed or skipped stage's message in the table: its cause; the log above has it whole."""


def clip(text: str, limit: int) -> str:
    """`text` up to `limit` characters, cut after a whole word with `…`."""
    if len(text) <= limit:
        return text
    cut = text[: limit - 1]
    return (cut.rsplit(" ", 1)[0] if " " in cut else cut).rstrip(" ,;:") + "…"


def _short(path: str) -> str:
    """Paths under the working directory are shown relative to it."""
    try:
        return str(Path(path).relative_to(Path.cwd()))
    except ValueError:
        return path


def summary_table(stages: list[dict], title: str) -> Table:
    t = Table(title=title, title_justify="left")
    for col in ("stage", "kind", "status", "duration", "key metric", "output"):
        t.add_column(col, overflow="fold")
    for s in stages:
        metric = f"{s['key_metric']} = {s['value']:.4g}" if s.get("key_metric") and s.get("value") is not None else ""
        status = f"[{STYLE.get(s['status'], '')}]{s['status']}[/]"
        if s.get("message"):
            status += "\n" + escape(clip(s["message"], MESSAGE_CHARS))
        t.add_row(
            s["stage_id"],
            s["kind"],
            status,
            f"{s['duration_s']:.1f}s" if s["duration_s"] else "-",
            metric,
            escape(_short(s.get("output", ""))),
        )
    return t


def print_summary(summary: dict, console: Console | None = None) -> None:
    console = console or Console(width=None if Console().is_terminal else 160)
    console.print(
        summary_table(summary["stages"], f"alignpipe · {summary['pipeline']} · run {summary['pipeline_run_id']}")
    )
    if summary.get("mlflow_run_id"):
        console.print(f"MLflow: {summary['tracking_uri']}  (parent run {summary['mlflow_run_id']})")


def dag_text(recipe, plans: dict | None = None) -> str:
    """Stages in run order, indented by dependency level, each with the stages it waits for (`after:`; a stage may
    wait for several, so this is a list with levels, not a tree) and what it reads."""
    order = recipe.topological_order()
    level: dict[str, int] = {}
    for s in order:
        level[s.id] = 1 + max((level[d] for d in s.dependencies()), default=0)
    depth = max(level.values())
    width = max(len(s.id) for s in order) + 2 * (depth - 1)
    kinds = max(len(s.kind) for s in order)
    waits = {s.id: f"after: {', '.join(s.dependencies())}" if s.dependencies() else "first" for s in order}
    waits_width = max(len(w) for w in waits.values())
    lines = [f"{recipe.name}: {len(order)} stages in {depth} levels, model {recipe.model.path}"]
    for s in order:
        reads = [f"{f}={v}" for f, v in s.references().items()]
        if hasattr(s, "dataset_names"):  # a format stage
            reads.append(f"dataset={'+'.join(s.dataset_names)}")
        state = ""
        if plans:  # a column of its own, where the eye finds it: reads vary in length
            state = f"{'[cached]' if plans[s.id].cached else '[will run]':<10}  "
        pool = f"  pool={s.resources.pool}" if s.resources.pool else ""
        name = "  " * (level[s.id] - 1) + s.id
        lines.append(
            f"  {name:<{width}}  {s.kind:<{kinds}}  {state}{waits[s.id]:<{waits_width}}  {' '.join(reads)}{pool}".rstrip()
        )
        done = plans[s.id].manifest if plans and plans[s.id].cached else None
        if done is not None:  # where its products are: what `vllm serve` or a notebook is pointed at
            lines += [f"  {'  ' * level[s.id]}{what}: {_shown_path(where)}" for what, where in done.outputs.items()]
    return "\n".join(lines)


def _shown_path(path: str) -> str:
    """A local path under the working directory as a relative one; anything else as it is."""
    if not Path(path).is_absolute():  # a storage URL, a registered model's `models:/…`
        return path
    try:
        return str(Path(path).relative_to(Path.cwd().resolve()))
    except ValueError:
        return path
