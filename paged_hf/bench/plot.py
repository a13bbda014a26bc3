"""The bench's plot (docs/img/bench_*.png) and its figures block, both carrying where and how they were measured.

Why: a figure without its host cannot be compared with another (AMD Zen 5 with AVX512-BF16 and an Intel Xeon
with AMX gave the same code 1.70x and 1.04x vLLM), and a plot drawn by older code, or quoted with other numbers
than it shows, is stale without anyone noticing. So each PNG stores in its text chunks (`savefig(metadata=...)`,
read back with `read_plot_metadata`): the host (CPU model, its AMX/AVX512-BF16/FP16 flags, the GPU), the
command, every figure of the bench's table as printed, and `DRAWING_CODE_HASH`, a fingerprint of this file. Its
title names the CPU. Beside it the bench writes `bench_<name>.md`, the block to paste into README/docs, between
`<!-- figures: ... -->` markers that tests/bench/test_plots.py checks against the PNG's figures.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

from paged_hf.bench.report import COLUMNS, output_name, table_rows

#: a fingerprint of the code that draws the plots: a plot in docs/img stored with another one is stale
DRAWING_CODE_HASH = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]
#: the prefix of this module's PNG text keys
KEY_PREFIX = "paged_hf."
FIELDS = ("host", "cpu", "command", "workload", "dtype", "date", "figures", "code_hash")


def plot_figures(report: dict) -> dict:
    """Every figure the plot and its table show, as printed: {system: {column: cell}} and the machine's limit."""
    figures = {row[0]: dict(zip(COLUMNS[1:], row[1:])) for row in table_rows(report)}
    ceiling = (report.get("machine") or {}).get("max_useful_tokens_per_s")
    if ceiling and math.isfinite(ceiling):
        figures["machine limit"] = {"tok/s": f"{ceiling:.0f}"}
    return figures


def plot_metadata(report: dict) -> dict[str, str]:
    settings = report["settings"]
    fields = {"host": settings.get("host") or "unknown host", "cpu": settings.get("cpu") or "unknown CPU",
              "command": settings.get("command") or "paged-hf bench", "workload": report["workload"]["name"],
              "dtype": settings.get("dtype") or "float32", "date": settings.get("date") or "",
              "figures": json.dumps(plot_figures(report)), "code_hash": DRAWING_CODE_HASH}
    return {KEY_PREFIX + name: value for name, value in fields.items()}


def read_plot_metadata(path: str | os.PathLike) -> dict:
    """What `write_plot` stored in a PNG ({} for a plot without it); `figures` decoded."""
    from PIL import Image  # noqa: PLC0415 - matplotlib's own dependency (the bench extra)

    with Image.open(path) as image:
        text = dict(getattr(image, "text", {}) or {})
    found = {key.removeprefix(KEY_PREFIX): value for key, value in text.items() if key.startswith(KEY_PREFIX)}
    if "figures" in found:
        found["figures"] = json.loads(found["figures"])
    return found


def write_plot(report: dict, out_dir: str) -> str | None:
    """A bar plot of useful tok/s per system (the machine's ceiling as a dashed line), titled with the host."""
    import matplotlib  # noqa: PLC0415 - optional dependency (the bench extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - after the backend is chosen

    measured = [(n, m["tokens_per_s"]) for n, m in report["systems"].items() if "tokens_per_s" in m]
    if not measured:
        return None
    names, values = zip(*measured)
    fig, ax = plt.subplots(figsize=(max(1.4 * len(names) + 2.5, 7), 4.4))
    bars = ax.bar(names, values, color=["tab:blue" if n.startswith("paged_hf") else "tab:gray" for n in names])
    ax.bar_label(bars, labels=[f"{v:.1f}" for v in values])
    ceiling = (report.get("machine") or {}).get("max_useful_tokens_per_s")
    if ceiling and math.isfinite(ceiling):
        ax.axhline(ceiling, color="tab:red", linestyle="--", label=f"machine limit {ceiling:.0f} tok/s")
        ax.legend(loc="upper right")
    w, settings = report["workload"], report["settings"]
    ax.set_title(f"{w['name']} workload: {w['num_requests']} requests, {w['new_tokens']} new tokens, "
                 f"{settings.get('dtype') or 'float32'}\n{settings.get('host') or 'unknown host'}", fontsize=10)
    ax.set_ylabel("useful generated tokens / s")
    ax.set_ylim(0, max([*values, ceiling or 0]) * 1.15)
    fig.tight_layout()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{output_name(report)}.png")
    fig.savefig(path, dpi=120, metadata=plot_metadata(report))
    plt.close(fig)
    return path


def figures_block(report: dict, plot_path: str) -> str:
    """The markdown to paste into README/docs for a plot: host, command and table between figures markers
    (`plot_path` as the page that quotes it names the PNG: `img/...` from docs/, `docs/img/...` from README)."""
    settings = report["settings"]
    threads = settings.get("threads") or settings.get("num_threads")
    threads = f"{threads} threads" if threads else "torch's default threads"
    rows = [list(COLUMNS), ["---"] * len(COLUMNS), *table_rows(report)]
    return "\n".join([
        f"<!-- figures: {plot_path} -->",
        f"Measured on {settings.get('host') or 'an unknown host'}, {threads}, {settings.get('dtype') or 'float32'}, "
        f"{settings.get('date') or 'undated'}:",
        "",
        "```bash",
        settings.get("command") or "paged-hf bench",
        "```",
        "",
        *("| " + " | ".join(row) + " |" for row in rows),
        "<!-- end figures -->",
        "",
    ])


def write_figures_block(report: dict, out_dir: str) -> str:
    """`bench_<name>.md` beside the plot: its figures block, for the docs (docs/img/ as the page's img/)."""
    name = output_name(report)
    path = os.path.join(out_dir, f"{name}.md")
    with open(path, "w") as fh:
        fh.write(figures_block(report, f"img/{name}.png"))
    return path
