"""The plot of `paged-hf bench --streams`: total tok/s against the number of streams, paged_hf and llama.cpp, one
panel per precision, titled with the host (docs/img/bench_llamacpp.png).

Like the other plots (plot.py), the PNG carries where and how it was measured in its text chunks: the host, the
command, every plotted figure, and a fingerprint of this file, so a plot drawn by older code or from other figures
than the report beside it is seen to be stale (tests/bench/test_bench_llamacpp.py).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from paged_hf.bench.plot import KEY_PREFIX

#: a fingerprint of the code that draws the curve plot
CURVE_CODE_HASH = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]
PLOT_FILE = "bench_llamacpp.png"
ENGINES = (("paged_hf", "tab:blue", "o"), ("llamacpp", "tab:gray", "s"))


def curve_figures(report: dict) -> dict:
    """{precision: {engine: {streams: total tok/s rounded to 0.1}}}: what the plot shows (missing points left out)."""
    figures = {}
    for row in report["rows"]:
        figures[row["precision"]] = {
            engine: {str(point["streams"]): round(point[engine]["total_tokens_per_s"], 1)
                     for point in row["curve"] if point[engine]["total_tokens_per_s"]}
            for engine, _, _ in ENGINES}
    return figures


def curve_metadata(report: dict) -> dict[str, str]:
    settings = report["settings"]
    fields = {"host": settings.get("host") or "unknown host", "cpu": settings.get("cpu") or "unknown CPU",
              "command": settings.get("command") or "paged-hf bench --streams", "workload": "streams",
              "date": settings.get("date") or "", "figures": json.dumps(curve_figures(report)),
              "code_hash": CURVE_CODE_HASH}
    return {KEY_PREFIX + name: value for name, value in fields.items()}


def write_curve_plot(report: dict, out_dir: str) -> str | None:
    """-> the PNG's path (None without any measured point): one panel per precision, log-scaled streams."""
    import matplotlib  # noqa: PLC0415 - optional dependency (the bench extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - after the backend is chosen

    figures = curve_figures(report)
    rows = [row for row in report["rows"] if any(figures[row["precision"]].values())]
    if not rows:
        return None
    fig, axes = plt.subplots(1, len(rows), figsize=(3.6 * len(rows) + 1, 3.8), squeeze=False)
    for ax, row in zip(axes[0], rows):
        for engine, color, marker in ENGINES:
            points = figures[row["precision"]][engine]
            streams = [int(n) for n in points]
            ax.plot(streams, list(points.values()), color=color, marker=marker,
                    label="paged_hf" if engine == "paged_hf" else "llama.cpp")
        ax.set_xscale("log", base=2)
        ax.set_xticks([point["streams"] for point in row["curve"]], [str(p["streams"]) for p in row["curve"]])
        ax.set_title(row["label"], fontsize=9)
        ax.set_xlabel("streams")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("new tokens / s, all streams")
    axes[0][0].legend(loc="upper left", fontsize=8)
    settings = report["settings"]
    fig.suptitle(f"{settings.get('model', '')}, {settings.get('prompt_tokens')}-token prompts, "
                 f"{settings.get('new_tokens')} new tokens, {settings.get('threads')} threads\n"
                 f"{settings.get('host') or 'unknown host'}", fontsize=10)
    fig.tight_layout()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, PLOT_FILE)
    fig.savefig(path, dpi=110, metadata=curve_metadata(report))
    plt.close(fig)
    return path
