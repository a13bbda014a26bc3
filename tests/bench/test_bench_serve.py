"""`paged-hf bench --serve` end to end on a tiny model: it starts `paged-hf serve`, drives it with its streaming
load generator, runs the same requests offline, and reports tok/s and latency percentiles."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")

from serve_process import save_tiny_model  # noqa: E402

from paged_hf.entrypoints import cli  # noqa: E402


def test_bench_serve_reports_server_and_offline_side_by_side(tmp_path, capsys):
    folder = save_tiny_model(tmp_path / "model")
    out = tmp_path / "out"
    code = cli.main(["bench", "--serve", "--model", folder, "--serve-systems", "paged_hf,vllm,offline",
                     "--vllm-python", str(tmp_path / "no-vllm" / "python"), "--num-prompts", "12",
                     "--concurrency", "4", "--request-rate", "50", "--input-len", "20", "--output-len", "9",
                     "--num-blocks", "128", "--threads", "1", "--out", str(out)])
    assert code == 0
    table = capsys.readouterr().out
    assert "| paged-hf serve | 12/12 |" in table and "of offline" in table
    report = json.loads((out / "serve_bench.json").read_text())
    served, vllm, offline = report["systems"]
    assert served["output_tokens"] == offline["output_tokens"] == 12 * 9  # EOS ignored: exactly output_len each
    assert vllm["skipped"]
    for key in ("ttft_s", "tpot_s", "itl_s"):
        assert 0 < served[key]["p50"] <= served[key]["p99"], key
    assert served["output_tok_s"] > 0 and offline["output_tok_s"] > 0


def test_bench_disaggregated_runs_the_split_and_the_replicas_on_one_mix(tmp_path, capsys):
    """`--disaggregated` on a tiny model: both setups answer every request of the mix (the long prompts' blocks
    through the producer's folder), and the table compares them."""
    folder = save_tiny_model(tmp_path / "model")
    out = tmp_path / "out"
    code = cli.main(["bench", "--serve", "--disaggregated", "--model", folder, "--streams", "4", "--long-prompts",
                     "2", "--long-input-len", "200", "--output-len", "8", "--request-rate", "20",
                     "--num-blocks", "128", "--out", str(out)])
    assert code == 0
    table = capsys.readouterr().out
    assert "| 1 prefill + 1 decode | 6/6 |" in table and "| 2 replicas | 6/6 |" in table
    assert "streams' gap p99" in table
    split, replicas = json.loads((out / "disaggregated_bench.json").read_text())["systems"]
    assert split["streams"]["output_tokens"] == replicas["streams"]["output_tokens"] == 4 * 8
    assert any(name.endswith(".safetensors") for name in (p.name for p in (out / "kv_blocks").iterdir()))
