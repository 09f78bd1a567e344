"""Win rates (ties count half) with Wilson score intervals."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass
class WinRate:
    wins: int
    ties: int
    losses: int
    win_rate: float
    ci_low: float
    ci_high: float

    @property
    def n(self) -> int:
        return self.wins + self.ties + self.losses

    def as_dict(self) -> dict:
        return asdict(self)


def wilson_interval(successes: float, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """Wilson score interval for a proportion (95% by default); `successes` may be fractional (ties = ½)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


# Scores closer than this are a tie: the same completion scored in two batches can differ in the last bits.
TIE_TOLERANCE = 1e-9


def verdict(candidate: float, baseline: float, tol: float = TIE_TOLERANCE) -> str:
    """'win' when the candidate's score is higher by more than `tol`, 'loss' when lower by more, else 'tie'."""
    return "win" if candidate > baseline + tol else "loss" if candidate < baseline - tol else "tie"


def win_rate(candidate: list[float], baseline: list[float], tol: float = TIE_TOLERANCE) -> WinRate:
    """Compare paired scores (one per prompt each), by `verdict`."""
    if len(candidate) != len(baseline):
        raise ValueError("candidate and baseline need one score per prompt each")
    return from_verdicts([verdict(c, b, tol) for c, b in zip(candidate, baseline)])


def from_verdicts(verdicts: list[str]) -> WinRate:
    """WinRate from 'win' / 'tie' / 'loss' verdicts."""
    wins, ties, losses = (sum(v == k for v in verdicts) for k in ("win", "tie", "loss"))
    n = wins + ties + losses
    rate = (wins + 0.5 * ties) / n if n else 0.0
    low, high = wilson_interval(wins + 0.5 * ties, n)
    return WinRate(wins, ties, losses, rate, low, high)


def matrix(models: list[str], pair_results: dict[tuple[str, str], WinRate]) -> list[list[float | None]]:
    """Row model's win rate against column model; the mirror of a judged pair is 1 − its rate; the
    diagonal and unjudged pairs are None."""
    out: list[list[float | None]] = []
    for a in models:
        row: list[float | None] = []
        for b in models:
            if (a, b) in pair_results:
                row.append(pair_results[(a, b)].win_rate)
            elif (b, a) in pair_results:
                row.append(1.0 - pair_results[(b, a)].win_rate)
            else:
                row.append(None)
        out.append(row)
    return out
