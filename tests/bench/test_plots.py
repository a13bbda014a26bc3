"""The plots in docs/img are fresh, and README/docs quote the figures they show, on the host they name.

Each plot stores (paged_hf/bench/plot.py) the host, the command, its figures and a fingerprint of the code that
drew it. README/docs quote a plot's figures in a block between `<!-- figures: PATH.png ... -->` and
`<!-- end figures -->` (the bench writes that block as bench_<name>.md beside the plot): every decimal number in
the block must be one the plot stores, and the block names the plot's CPU. The first tests check this rule on a
plot drawn here; the last one applies it to docs/img, and fails until the plots there are regenerated with
REGENERATE on a quiet machine.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from paged_hf.bench import plot  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
REGENERATE = ("`make bench-docs` (every docs/img plot, on a quiet machine; docs/benchmarks.md, 'Regenerating the "
              "figures'), then paste each docs/img/bench_*.md block over the block of the same plot in README.md / "
              "docs/benchmarks.md")
BLOCK = re.compile(r"<!-- figures: (?P<plots>[^>]*?) -->(?P<body>.*?)<!-- end figures -->", re.S)
#: a decimal figure ("272.9", "1.52" of "1.52x"), not a version's part ("0.32.0")
DECIMAL = re.compile(r"(?<![\w.])\d+\.\d+(?![\d.])")


def synthetic_report(paged_tok_s: float = 272.94) -> dict:
    """A report as paged_hf.bench.report.build_report makes it, for two systems."""
    def system(tok_s, speedup, identical):
        return {"tokens_per_s": tok_s, "wall_s": 3200 / tok_s, "ttft_p50_s": 7.16, "tpot_p50_s": 0.127,
                "peak_rss_bytes": 2.97e9, "paged_hf_speedup": speedup,
                "outputs_vs_reference": {"identical": identical, "compared": 64}}

    return {"workload": {"name": "mixed", "num_requests": 64, "new_tokens": 6863},
            "settings": {"dtype": "float32", "threads": 2, "host": "AMD EPYC 9B45 (avx512_bf16; no AMX)",
                         "cpu": "AMD EPYC 9B45", "date": "2026-12-01",
                         "command": "paged-hf bench --workload mixed --max-new-tokens-scale 0.25 --out docs/img"},
            "systems": {"paged_hf": system(paged_tok_s, 1.0, 64), "vllm": system(179.1, paged_tok_s / 179.1, 64)},
            "machine": {"max_useful_tokens_per_s": 548.2}}


def block_problems(page: Path, plots: list[str], body: str) -> list[str]:
    """What is wrong with one figures block of `page` quoting `plots` (paths from the page's folder)."""
    problems, allowed, cpus = [], set(), []
    for name in plots:
        path = page.parent / name
        stored = plot.read_plot_metadata(path) if path.is_file() else None
        if not stored:
            problems.append(f"{page.name}: {name} {'has no stored figures' if stored == {} else 'does not exist'}")
            continue
        if stored.get("code_hash") != plot.DRAWING_CODE_HASH:
            problems.append(f"{page.name}: {name} was drawn by other code than paged_hf/bench/plot.py's")
        cells = [cell for row in stored["figures"].values() for cell in row.values()]
        allowed |= set(DECIMAL.findall(" ".join([*cells, stored["host"], stored["command"]])))
        cpus.append(stored["cpu"])
    problems += [f"{page.name}: the block for {plots} does not name the CPU {cpu!r}" for cpu in cpus if cpu not in body]
    if len(cpus) == len(plots):
        problems += [f"{page.name}: {figure} is not a figure of {plots}" for figure in DECIMAL.findall(body)
                     if figure not in allowed]
    return problems


def page_problems(page: Path, text: str) -> list[str]:
    problems = []
    for match in BLOCK.finditer(text):
        problems += block_problems(page, match["plots"].split(), match["body"])
    return problems


def test_a_plot_stores_its_host_command_figures_and_the_code_that_drew_it(tmp_path):
    report = synthetic_report()
    path = Path(plot.write_plot(report, str(tmp_path)))
    assert path.name == "bench_mixed.png"
    stored = plot.read_plot_metadata(path)
    assert stored["code_hash"] == plot.DRAWING_CODE_HASH and stored["cpu"] == "AMD EPYC 9B45"
    assert stored["host"] == report["settings"]["host"] and stored["command"] == report["settings"]["command"]
    assert stored["figures"]["paged_hf"]["tok/s"] == "272.9" and stored["figures"]["vllm"]["paged_hf x"] == "1.52x"
    assert stored["figures"]["machine limit"] == {"tok/s": "548"}
    bf16 = dict(report, settings=dict(report["settings"], dtype="bfloat16"))
    assert Path(plot.write_plot(bf16, str(tmp_path))).name == "bench_mixed_bfloat16.png"


def test_the_figures_block_the_bench_writes_passes_and_a_changed_figure_fails(tmp_path):
    report = synthetic_report()
    plot.write_plot(report, str(tmp_path / "img"))
    block = Path(plot.write_figures_block(report, str(tmp_path / "img"))).read_text()
    page = tmp_path / "page.md"
    assert page_problems(page, block) == [] and "AMD EPYC 9B45" in block and "| paged_hf | 272.9 |" in block
    wrong = page_problems(page, block.replace("272.9", "486.4"))
    assert wrong == ["page.md: 486.4 is not a figure of ['img/bench_mixed.png']"]
    assert "does not name the CPU" in page_problems(page, block.replace("AMD EPYC 9B45", "an AMD CPU"))[0]
    plot.write_plot(synthetic_report(paged_tok_s=300.0), str(tmp_path / "img"))  # a newer run: the block is stale
    assert "272.9 is not a figure" in " ".join(page_problems(page, block))


def test_a_plot_drawn_by_other_code_is_stale(tmp_path, monkeypatch):
    report = synthetic_report()
    monkeypatch.setattr(plot, "DRAWING_CODE_HASH", "0123456789abcdef")
    plot.write_plot(report, str(tmp_path / "img"))
    block = plot.figures_block(report, "img/bench_mixed.png")
    monkeypatch.undo()
    assert page_problems(tmp_path / "page.md", block) == [
        "page.md: img/bench_mixed.png was drawn by other code than paged_hf/bench/plot.py's"]


def test_the_plots_in_docs_are_fresh_and_quoted_as_they_are():
    """Fails until docs/img is regenerated by the current plotting code (see REGENERATE)."""
    problems, quoted = [], set()
    for page in PAGES:
        text = page.read_text()
        problems += page_problems(page, text)
        quoted |= {(page.parent / name).resolve() for m in BLOCK.finditer(text) for name in m["plots"].split()}
    for png in sorted((ROOT / "docs" / "img").glob("*.png")):
        stored = plot.read_plot_metadata(png)
        if stored.get("workload") == "streams":  # bench --streams' curve: its own code, checked by test_peer_plot.py
            continue
        if stored.get("code_hash") != plot.DRAWING_CODE_HASH:
            problems.append(f"docs/img/{png.name}: {'drawn by other code' if stored else 'stores no figures'}")
        if png.resolve() not in quoted:
            problems.append(f"docs/img/{png.name}: no README/docs figures block quotes it")
    assert not problems, "stale plots or figures; regenerate with " + REGENERATE + ":\n" + "\n".join(
        dict.fromkeys(problems))
