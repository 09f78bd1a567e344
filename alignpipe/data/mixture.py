"""A format stage's dataset mixture: several raw datasets' rows, mapped to canonical columns, as one list."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from alignpipe.data.formats import SOURCE, map_columns

FORMAT_COLUMNS = ("text", "messages", "prompt", "completion", "chosen", "rejected", "label")
"""Columns the formats read; any other (`answer` included) is carried through to the formatted rows."""


@dataclass
class Source:
    name: str
    rows: list[dict]
    """Raw rows, with the source's own column names."""
    columns: dict[str, str] = field(default_factory=dict)
    """Canonical column → the source's (the recipe's `datasets.<name>.columns`)."""


@dataclass
class Mixture:
    rows: list[dict]
    """Canonical-named rows, each tagged with its dataset under `formats.SOURCE`."""
    taken: dict[str, int]
    """Rows taken from each dataset."""
    dropped_columns: dict[str, list[str]]
    """Carried columns only some datasets have, by dataset: left out so the formatted rows share their columns."""


def mix(sources: list[Source], weights: list[float] | None, shuffle: bool, seed: int) -> Mixture:
    """Every row of each source, or with `weights` the largest mixture of those shares (normalised) that takes no
    row twice: round(share × size) rows of each, where size = min over sources of rows / share (TRL's dataset
    mixtures' `fraction`). Rows are drawn at random (each source its own stream of `seed`) with `shuffle`, else
    each source's first. Sources come in their order; the format stage shuffles the whole after."""
    mapped = [map_columns(s.rows, s.columns) for s in sources]
    if weights is not None:
        shares = [w / sum(weights) for w in weights]
        size = min(len(rows) / share for rows, share in zip(mapped, shares, strict=True))
        picked = []
        for s, rows, share in zip(sources, mapped, shares, strict=True):
            order = list(range(len(rows)))
            if shuffle:
                random.Random(f"{seed}:{s.name}").shuffle(order)
            picked.append([rows[i] for i in sorted(order[: round(share * size)])])
        mapped = picked
    # a dataset's rows share its columns (an empty one has none to compare)
    carried = {s.name: set(rows[0]) - set(FORMAT_COLUMNS) for s, rows in zip(sources, mapped, strict=True) if rows}
    common = set.intersection(*carried.values()) if carried else set()
    dropped = {name: sorted(c - common) for name, c in carried.items() if c - common}
    out = [
        {**{k: v for k, v in row.items() if k not in dropped.get(s.name, ())}, SOURCE: s.name}
        for s, rows in zip(sources, mapped, strict=True)
        for row in rows
    ]
    taken = {s.name: len(rows) for s, rows in zip(sources, mapped, strict=True)}
    return Mixture(out, taken, dropped)
