"""Figures saved as MLflow artifacts (matplotlib, headless)."""

from __future__ import annotations


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def curves_figure(tracker, keys: list[str], title: str):
    """Line plot of logged metrics against step; None when nothing was logged."""
    series = {k: [(s, m[k]) for s, m in tracker.history if k in m] for k in keys}
    series = {k: v for k, v in series.items() if v}
    if not series:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for k, pts in series.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o" if len(pts) < 3 else None, label=k)
    ax.set_xlabel("step")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    return fig


def win_rate_figure(rows: list[dict], title: str):
    """Bars of win rate per (candidate, baseline) with Wilson 95% intervals."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(4, 1.6 * len(rows)), 3.5))
    labels = [f"{r['candidate']}\nvs {r['baseline']}" for r in rows]
    rates = [r["win_rate"] for r in rows]
    err = [[r["win_rate"] - r["ci_low"] for r in rows], [r["ci_high"] - r["win_rate"] for r in rows]]
    ax.bar(labels, rates, yerr=err, capsize=6, color="#4c72b0")
    ax.axhline(0.5, color="grey", linestyle="--", linewidth=1)
    ax.set_ylim(0, 1)
    ax.set_ylabel("win rate (ties = ½)")
    ax.set_title(title)
    fig.tight_layout()
    return fig
