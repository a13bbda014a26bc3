"""`paged-hf bench` with quantized-cache systems: the same KV memory holds more blocks and runs more requests."""

from __future__ import annotations

import tempfile

from conftest import real_tokenizer, tiny_model_for

from paged_hf.bench import parse_systems, sized_engine_config
from paged_hf.bench.documents import build_documents
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


def test_documents_turns_reuse_each_document_and_the_tiers_serve_them_with_the_same_tokens():
    """Three documents, two turns, a pool of one document: turn 2 re-reads each document from host memory or the
    directory (prefix hits the tier-less engine cannot have), with paged_hf's tokens; turn 2 runs after turn 1."""
    tokenizer = real_tokenizer()
    model = tiny_model_for(tokenizer)
    workload = build_documents(tokenizer, num_documents=3, num_turns=2, document_tokens=120, new_range=(4, 6),
                               pool_documents=1)
    assert [r.wave for r in workload.requests] == [0, 0, 0, 1, 1, 1]  # turn-major: every document, then again
    prompts = [r.prompt_token_ids for r in workload.requests]
    assert all(prompts[d][:100] == prompts[3 + d][:100] for d in range(3))  # the document first: a shared prefix
    assert len({tuple(p[:60]) for p in prompts[:3]}) == 3  # distinct documents
    engine = sized_engine_config({"max_num_batched_tokens": 64}, workload)
    assert engine["num_blocks"] == workload.num_blocks < sum(len(p) for p in prompts[:3]) // 16
    systems = parse_systems(None, "documents")
    assert systems == ["paged_hf", "paged_hf_kvhost", "paged_hf_kvdisk"]
    runs = {name: run_system(name, model, tokenizer, workload, engine) for name in systems}
    assert all(run.error is None and run.outputs == runs["paged_hf"].outputs for run in runs.values()), runs
    plain_hits = runs["paged_hf"].extra["prefix_cache_hits"]
    for name in ("paged_hf_kvhost", "paged_hf_kvdisk"):
        tier = runs[name].extra["kv_tier"]
        assert tier["kv_tier_hits"] >= 3 * 100 // 16 * 16, (name, tier)  # each document's turn-2 prefix
        assert runs[name].extra["prefix_cache_hits"] >= plain_hits + tier["kv_tier_hits"], (name, runs[name].extra)
    assert runs["paged_hf_kvhost"].extra["engine_config"]["kv_offloading_size"] > 0
    report = build_report(workload, runs, None, {"systems": systems})
    assert report["reference_system"] == "paged_hf"
    assert report["systems"]["paged_hf_kvhost"]["outputs_vs_reference"]["identical"] == len(prompts)
