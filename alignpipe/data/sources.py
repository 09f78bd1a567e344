"""Reading raw datasets from local files, saved `datasets` directories or the Hub."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

FILE_TYPES = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_id(path: str) -> bool:
    """True for `org/name` that is not an existing local path (so it is read from the Hub)."""
    return bool(_HUB_ID.match(path)) and not Path(path).exists() and Path(path).suffix.lower() not in FILE_TYPES


def source_type(path: str, declared: str = "auto") -> str:
    """json | csv | parquet | arrow | hub."""
    if declared != "auto":
        return declared
    p = Path(path).expanduser()
    if p.suffix.lower() in FILE_TYPES:
        return FILE_TYPES[p.suffix.lower()]
    if p.is_dir():
        return "arrow"
    if is_hub_id(path):
        return "hub"
    return "json"


def peek_columns(path: str, kind: str) -> list[str] | None:
    """Column names of a local dataset without loading it; None if it can't be told cheaply."""
    p = Path(path).expanduser()
    if kind == "json":
        with p.open() as f:
            head = f.read(1)
            f.seek(0)
            if head == "[":
                rows = json.load(f)
                first = rows[:50]
            else:
                first = [json.loads(line) for _, line in zip(range(50), f) if line.strip()]
        cols: list[str] = []
        for row in first:
            cols += [k for k in row if k not in cols]
        return cols
    if kind == "csv":
        with p.open(newline="") as f:
            return next(csv.reader(f), [])
    if kind == "parquet":
        import pyarrow.parquet as pq

        return list(pq.read_schema(p).names)
    if kind == "arrow":
        info = next(p.rglob("dataset_info.json"), None)
        if info:
            return list(json.loads(info.read_text()).get("features", {}))
    return None


def load_raw(
    path: str, kind: str = "auto", split: str = "train", subset: str | None = None, revision: str | None = None
):
    """Load a raw dataset as a `datasets.Dataset` (one split)."""
    import datasets

    kind = source_type(path, kind)
    if kind == "hub":
        return datasets.load_dataset(path, subset, split=split, revision=revision)
    if kind == "arrow":
        ds = datasets.load_from_disk(str(Path(path).expanduser()))
        return ds[split] if isinstance(ds, datasets.DatasetDict) else ds
    return datasets.load_dataset(kind, data_files=str(Path(path).expanduser()), split="train")
