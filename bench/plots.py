"""PNG plots for the reports (matplotlib, headless). Without matplotlib each plot is skipped with a message.

Each function takes the summary a benchmark already wrote to JSON and returns the list of files it wrote.
"""

from __future__ import annotations

import math


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[plots] matplotlib not installed: no PNG (pip install -e '.[bench]')", flush=True)
        return None
    return plt


def _rate_x(rates: list[str]) -> tuple[list[float], list[str]]:
    """Finite rates at their value; inf one step past the largest, labelled 'inf'."""
    finite = [float(r) for r in rates if not math.isinf(float(r))]
    top = max(finite, default=1.0)
    xs = [float(r) if not math.isinf(float(r)) else top * 2 for r in rates]
    return xs, [r if not math.isinf(float(r)) else "inf" for r in rates]


def latency_vs_rate(summary: dict, path: str) -> list[str]:
    """serve: TTFT p50/p99, TPOT p50 and output tok/s against request rate, one line per engine."""
    plt = _pyplot()
    if plt is None or not summary:
        return []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = [("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"), ("output_tok_s", "output tokens/s")]
    for ax, (key, label) in zip(axes, panels):
        for name, by_rate in summary.items():
            rates = list(by_rate)
            xs, ticks = _rate_x(rates)
            if key == "output_tok_s":
                ax.plot(xs, [by_rate[r][key] for r in rates], "o-", label=name)
            else:
                line, = ax.plot(xs, [by_rate[r][key]["p50"] for r in rates], "o-", label=f"{name} p50")
                ax.plot(xs, [by_rate[r][key]["p99"] for r in rates], "x--", color=line.get_color(), label=f"{name} p99")
            ax.set_xticks(xs, ticks)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Serving under Poisson load")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def bars(values: dict[str, float], path: str, *, title: str, ylabel: str, baseline: float | None = None) -> list[str]:
    """One bar per label (throughput per engine, speedup per method); optional dashed baseline (e.g. 1.0x)."""
    plt = _pyplot()
    if plt is None or not values:
        return []
    fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(values) + 2), 4))
    labels = list(values)
    bs = ax.bar(range(len(labels)), [values[k] for k in labels], color="#4C72B0")
    ax.bar_label(bs, fmt="%.2f", fontsize=8)
    ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right", fontsize=8)
    if baseline is not None:
        ax.axhline(baseline, color="gray", linestyle="--", linewidth=1)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def grouped_bars(groups: dict[str, dict[str, float]], path: str, *, title: str, ylabel: str) -> list[str]:
    """Bars grouped by outer key (e.g. KV dtype), one colour per inner key (e.g. context length)."""
    plt = _pyplot()
    if plt is None or not groups:
        return []
    outer = list(groups)
    inner = list(dict.fromkeys(k for g in groups.values() for k in g))
    width = 0.8 / max(1, len(inner))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(outer) + 2), 4))
    for i, key in enumerate(inner):
        xs = [j + i * width for j in range(len(outer))]
        b = ax.bar(xs, [groups[o].get(key, 0) for o in outer], width, label=key)
        ax.bar_label(b, fontsize=7)
    ax.set_xticks([j + width * (len(inner) - 1) / 2 for j in range(len(outer))], outer, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
