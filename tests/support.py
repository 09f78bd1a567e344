"""Helpers the tests import (`from support import ...`; pytest puts tests/ on the path): recipes and data
built from the tiny assets."""

from __future__ import annotations

from pathlib import Path


def tiny_split(tiny: Path, name: str, fmt: str, rows: int | None = None, **kwargs):
    """(tokenizer, train rows, eval rows) of the tiny data file `name`.jsonl, formatted as `fmt` (10% held out)."""
    import json

    from alignpipe.data.formats import format_rows
    from alignpipe.modeling import load_tokenizer

    tok = load_tokenizer(str(tiny / "model"))
    raw = [json.loads(line) for line in (tiny / "data" / f"{name}.jsonl").read_text().splitlines()][:rows]
    train, evals, _ = format_rows(raw, fmt=fmt, tokenizer=tok, eval_fraction=0.1, **kwargs)
    return tok, train, evals


def demo_recipe(tiny: Path, workdir: Path, **extra) -> str:
    """pipelines/tiny-demo.yaml with absolute asset paths and a private workdir."""
    text = (Path(__file__).parents[1] / "pipelines" / "tiny-demo.yaml").read_text()
    text = text.replace("assets/tiny", str(tiny)).replace("./runs", str(workdir))
    return text
