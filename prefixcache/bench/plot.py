"""The PNG: per workload, mean TTFT and output tokens/s for every system (one bar per dtype)."""
from __future__ import annotations

from pathlib import Path

from prefixcache.bench import metrics
from prefixcache.bench.runner import BenchResult
from prefixcache.plotting import pyplot


def plot(result: BenchResult, path: Path) -> Path:
    plt = pyplot()  # PlottingUnavailable without the `bench` extra
    names = list(dict.fromkeys(r.workload for r in result.runs))
    dtypes = list(result.options.dtypes)
    fig, axes = plt.subplots(2, len(names), figsize=(4.2 * len(names), 6.4), squeeze=False)
    width = 0.8 / len(dtypes)
    for col, workload in enumerate(names):
        for k, dtype in enumerate(dtypes):
            run = next((r for r in result.runs if r.workload == workload and r.dtype == dtype), None)
            if run is None:
                continue
            summaries = metrics.summarize(run)
            xs = [i + (k - (len(dtypes) - 1) / 2) * width for i in range(len(summaries))]
            ttft = [s.ttft_mean for s in summaries]
            tput = [s.tokens_per_s or 0.0 for s in summaries]
            axes[0][col].bar(xs, ttft, width, label=dtype)
            axes[1][col].bar(xs, tput, width, label=dtype)
            for ax in (axes[0][col], axes[1][col]):
                ax.set_xticks(range(len(summaries)), [s.system for s in summaries], rotation=30, ha="right",
                              fontsize=8)
        axes[0][col].set_title(workload)
        axes[0][col].set_ylabel("mean TTFT (s, lower is better)")
        axes[1][col].set_ylabel("output tokens/s (higher is better)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"prefixcache bench, preset {result.options.preset}: "
                 f"{', '.join(sorted(set(result.models.values())))}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
