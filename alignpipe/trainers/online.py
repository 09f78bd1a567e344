"""Helpers the online RL trainers (GRPO, PPO) share: batching rollouts and showing samples."""

from __future__ import annotations

import sys

TEXT_COLUMNS = ("prompt", "completion", "chosen", "rejected", "text", "messages")


def extra_columns(rows: list[dict]) -> dict[str, list]:
    """Dataset columns other than the texts (e.g. `answer`), as reward functions receive them."""
    return {k: [r.get(k) for r in rows] for k in rows[0] if k not in TEXT_COLUMNS} if rows else {}


def print_samples(rows: list[dict], title: str) -> None:
    """A rich table of (prompt, completion, reward) on stdout, which the stage streams to Prefect's log."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left", show_lines=False)
    for col in ("prompt", "completion", "reward"):
        table.add_column(col, overflow="fold")
    for r in rows:
        table.add_row(r["prompt"][-60:], r["completion"][:80], f"{r['reward']:.3f}")
    Console(file=sys.stdout, width=140).print(table)
