"""Helpers the online RL trainers (GRPO, PPO) share: batching rollouts, syncing the engine and showing samples."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

TEXT_COLUMNS = ("prompt", "completion", "chosen", "rejected", "text", "messages")


def extra_columns(rows: list[dict]) -> dict[str, list]:
    """Dataset columns other than the texts (e.g. `answer`), as reward functions receive them."""
    return {k: [r.get(k) for r in rows] for k in rows[0] if k not in TEXT_COLUMNS} if rows else {}


def prompt_ids(tokenizer, rows: list[dict], max_prompt_length: int | None) -> list[list[int]]:
    """Each row's prompt as token ids (one BOS, `special_tokens.encode`), only its last `max_prompt_length` kept."""
    from alignpipe.special_tokens import encode

    ids = encode(tokenizer, [r["prompt"] for r in rows])
    return [x[-max_prompt_length:] if max_prompt_length else x for x in ids]


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


def sync_weights(engine, model, count_sync: Callable[[float], None]) -> None:
    """The policy's current weights into the rollout engine before it samples. Where the engine copies them (a vLLM
    engine's load, a vLLM server's adapter: `copies_weights`) the call's wall time goes to the window's
    `generation/sync_time_share`; the hf engine samples from the policy itself and counts nothing."""
    started = time.perf_counter()
    engine.update_weights(model)
    if getattr(engine, "copies_weights", False):
        count_sync(time.perf_counter() - started)
