"""The streams curve plot (`paged-hf bench --streams`): it shows the report's figures, stores them with the host and
command, and the plot in docs/img is the one the current code draws from the report beside it."""

from __future__ import annotations

import json
from pathlib import Path

from paged_hf.bench.peer_plot import CURVE_CODE_HASH, curve_figures, write_curve_plot
from paged_hf.bench.plot import read_plot_metadata

IMG = Path(__file__).resolve().parents[2] / "docs" / "img"


def test_the_plot_stores_the_reports_figures_and_host(tmp_path):
    report = json.loads((IMG / "bench_llamacpp.json").read_text())
    metadata = read_plot_metadata(write_curve_plot(report, str(tmp_path)))
    assert metadata["figures"] == curve_figures(report)
    assert metadata["host"] == report["settings"]["host"] and metadata["command"] == report["settings"]["command"]
    bfloat16 = metadata["figures"]["bfloat16"]
    assert set(bfloat16) == {"paged_hf", "llamacpp"} and set(bfloat16["paged_hf"]) == {"1", "2", "4", "8", "16"}


def test_the_docs_plot_is_current():
    """Redraw with `write_curve_plot(json.load(open('docs/img/bench_llamacpp.json')), 'docs/img')`."""
    report = json.loads((IMG / "bench_llamacpp.json").read_text())
    metadata = read_plot_metadata(IMG / "bench_llamacpp.png")
    assert metadata["code_hash"] == CURVE_CODE_HASH and metadata["figures"] == curve_figures(report)
