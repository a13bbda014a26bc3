"""`paged-hf bench` with quantized-cache systems: the same KV memory holds more blocks and runs more requests."""

from __future__ import annotations

import tempfile

from conftest import real_tokenizer, tiny_model_for

from paged_hf.bench import parse_systems
from paged_hf.bench.report import build_report, format_table
from paged_hf.bench.systems import run_system
from paged_hf.bench.workloads import BenchRequest, Workload


def test_kv_dtype_systems_run_more_requests_in_the_same_memory():
    tokenizer = real_tokenizer()
    model = tiny_model_for(tokenizer)  # float32, 2 layers, 2 KV heads of 8: 4096 bytes a block, int8 1056
    workload = Workload("t", "", 0, [BenchRequest(list(range(100 + i, 130 + i)), 20) for i in range(12)])
    systems = parse_systems("paged_hf,paged_hf_kv_int8,paged_hf_kv_fp8_e4m3", "mixed")
    engine = {"kv_cache_memory": 8 * 4096, "max_num_batched_tokens": 64}
    runs = {name: run_system(name, model, tokenizer, workload, engine) for name in systems}
    auto, int8, fp8 = (runs[name].extra for name in systems)
    assert (auto["num_blocks"], int8["num_blocks"], fp8["num_blocks"]) == (8, 31, 31)
    assert (auto["kv_cache_dtype"], int8["kv_cache_dtype"]) == ("auto", "int8")
    assert int8["max_num_running"] >= 3 * auto["max_num_running"] >= 3
    assert all(len(out) == 20 for run in runs.values() for out in run.outputs)
    report = build_report(workload, runs, None, {"systems": systems})
    assert "KV cache: paged_hf auto 8 blocks, at most" in format_table(report)
    assert "paged_hf_kv_int8 int8 31 blocks" in format_table(report)


def test_kvdisk_system_writes_through_a_fresh_folder_and_changes_no_token():
    """paged_hf_kvdisk: the same greedy tokens as paged_hf, its engine with a KV directory that nothing hits."""
    tokenizer = real_tokenizer()
    model = tiny_model_for(tokenizer)
    workload = Workload("t", "", 0, [BenchRequest(list(range(100 + 40 * i, 164 + 40 * i)), 8) for i in range(4)])
    runs = {name: run_system(name, model, tokenizer, workload, {"max_num_batched_tokens": 64})
            for name in parse_systems("paged_hf,paged_hf_kvdisk", "mixed")}
    assert runs["paged_hf_kvdisk"].error is None and runs["paged_hf_kvdisk"].outputs == runs["paged_hf"].outputs
    assert runs["paged_hf_kvdisk"].extra["engine_config"]["kv_cache_dir"].startswith(tempfile.gettempdir())
    assert "kv_cache_dir" not in runs["paged_hf"].extra["engine_config"]
    tier = runs["paged_hf_kvdisk"].extra["kv_tier"]
    assert tier["kv_tier_bytes_written"] > 0 and tier["kv_tier_bytes_read"] == 0  # written through, never hit
