"""PNG plots of the benchmarks (`--plot`): latency CDFs and throughput over time. matplotlib is
the `plots` extra; without it `--plot` stops with one line saying so."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit("--plot needs matplotlib: pip install 'tessera[plots]'") from exc
    return plt


def _cdf(ax, series: dict[str, list[float]], xlabel: str) -> None:
    for name, values in series.items():
        s = sorted(v * 1e3 for v in values)
        if s:
            ax.step(s, [(i + 1) / len(s) for i in range(len(s))], where="post", label=f"{name} (n={len(s)})")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of requests at or below")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def tokens_per_second(steps: list[tuple[float, int]], num_bins: int | None = None) -> tuple[list[float], list[float]]:
    """Tokens per second in `num_bins` equal slices of the run (default: up to 40, at least about
    five steps each, so a short run does not draw single steps as spikes): (midpoints, rates)."""
    if not steps:
        return [], []
    num_bins = num_bins or max(1, min(40, len(steps) // 5))
    end = steps[-1][0]
    width = end / num_bins if end > 0 else 1.0
    counts = [0] * num_bins
    for t, k in steps:
        counts[min(num_bins - 1, int(t / width))] += k
    return [(i + 0.5) * width for i in range(num_bins)], [c / width for c in counts]


def plot_latency_cdfs(series: dict[str, list[float]], path: str | Path, title: str = "") -> None:
    """One panel per series (seconds in, milliseconds on the axis): their latencies differ by orders."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(series), figsize=(4.2 * len(series), 3.4), squeeze=False)
    for ax, (name, values) in zip(axes[0], series.items(), strict=True):
        _cdf(ax, {name: values}, f"{name} (ms)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_throughput(steps: list[tuple[float, int]], latencies: dict[str, list[float]], path: str | Path,
                    title: str = "") -> None:
    """Output tokens/s over the run (left) and the requests' latency CDFs (right)."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    x, y = tokens_per_second(steps)
    left.plot(x, y)
    left.set_xlabel("seconds into the run")
    left.set_ylabel("output tokens/s")
    left.set_ylim(bottom=0)
    left.grid(alpha=0.3)
    _cdf(right, latencies, "ms from the start of the run")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
