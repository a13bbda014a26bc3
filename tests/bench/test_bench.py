"""The benchmark tool and the `paged-hf` command: workloads, the machine-limit arithmetic, the report, `generate`
on a JSONL file, and a smoke run of `paged-hf bench` through its entry point on the real default model."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import tiny_model_for

from paged_hf.bench import machine, median_run, parse_systems, sized_engine_config, vllm_system
from paged_hf.bench.adapters import random_adapters
from paged_hf.bench import report as report_module
from paged_hf.bench.report import build_report, format_table, useful_tokens
from paged_hf.bench.systems import SystemRun, run_system, skip_reason
from paged_hf.bench.workloads import LORA_ADAPTERS, BenchRequest, Workload, build_workload
from paged_hf.entrypoints import cli
from paged_hf.utils import percentile


@pytest.fixture(scope="module")
def tokenizer(loaded):
    return loaded[1]


@pytest.fixture
def default_cache(converted, monkeypatch):
    """Point the default model at the session's converted checkpoint (no writes to the user's cache)."""
    monkeypatch.setenv("PAGED_HF_CACHE", str(Path(converted[0]).parent))
    return Path(converted[0]).parent


# --- workloads ------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_workloads_have_their_sizes_and_are_deterministic(tokenizer):
    mixed = build_workload("mixed", tokenizer, seed=0)
    assert len(mixed.requests) == 64
    assert all(16 <= len(r.prompt_token_ids) <= 640 for r in mixed.requests)
    assert all(16 <= r.max_new_tokens <= 200 for r in mixed.requests)
    assert max(len(r.prompt_token_ids) for r in mixed.requests) > 400  # really mixed, not all short
    assert build_workload("mixed", tokenizer, seed=0) == mixed  # same seed, same token ids
    assert build_workload("mixed", tokenizer, seed=1).requests != mixed.requests

    prefix = build_workload("prefix", tokenizer)
    assert len(prefix.requests) == 24
    first, second = prefix.requests[0].prompt_token_ids, prefix.requests[1].prompt_token_ids
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert shared >= 780 and len({tuple(r.prompt_token_ids) for r in prefix.requests}) == 24

    decode = build_workload("decode", tokenizer)
    assert all(len(r.prompt_token_ids) < 80 and r.max_new_tokens >= 128 for r in decode.requests)

    lora = build_workload("lora", tokenizer)
    assert [r.prompt_token_ids for r in lora.requests] == [r.prompt_token_ids for r in mixed.requests]
    assert {r.adapter for r in lora.requests} == {*LORA_ADAPTERS, None} and lora.needs_adapters


@pytest.mark.slow
def test_requests_and_scale_shrink_a_workload_from_its_start(tokenizer):
    full = build_workload("mixed", tokenizer)
    small = build_workload("mixed", tokenizer, num_requests=4, max_new_tokens_scale=0.1)
    assert [r.prompt_token_ids for r in small.requests] == [r.prompt_token_ids for r in full.requests[:4]]
    assert [r.max_new_tokens for r in small.requests] == [max(1, round(r.max_new_tokens * 0.1))
                                                         for r in full.requests[:4]]
    assert Workload.from_json(json.loads(json.dumps(small.to_json()))) == small
    with pytest.raises(ValueError, match="unknown workload"):
        build_workload("nope", tokenizer)


def test_systems_and_kv_cache_sizing():
    assert parse_systems(None, "prefix")[:2] == ["paged_hf", "paged_hf_noprefix"]
    assert parse_systems("hf_cb, paged_hf,hf_cb", "mixed") == ["hf_cb", "paged_hf"]
    with pytest.raises(ValueError, match="unknown system"):
        parse_systems("paged_hf,vllm_gpu", "mixed")
    assert "vllm" in parse_systems(None, "mixed")  # side by side by default (skipped without its interpreter)
    workload = Workload("t", "", 0, [BenchRequest([1] * 20, 13), BenchRequest([1] * 3, 1)])
    assert sized_engine_config({}, workload)["num_blocks"] == 3 + 1 + 4  # ceil(33/16) + ceil(4/16) + warm-up
    assert sized_engine_config({"num_blocks": 7}, workload) == {"num_blocks": 7}


def test_lora_workload_is_skipped_clearly_without_adapters():
    lora = Workload("lora", "", 0, [BenchRequest([1, 2], 2, "lora_a"), BenchRequest([3], 2, None)])
    assert "lora_a" in skip_reason("paged_hf", lora, {}) and "--adapter" in skip_reason("paged_hf", lora, {})
    assert "skipped" in skip_reason("hf_static_8", lora, {}) and "skipped" in skip_reason("hf_cb", lora, {})
    assert skip_reason("hf_single", lora, {"adapters": {"lora_a": "/a"}}) is None  # peft's own batches
    assert skip_reason("paged_hf", Workload("mixed", "", 0, [BenchRequest([1], 1)]), {}) is None


@pytest.mark.slow
def test_lora_scaling_runs_random_adapters_beside_the_base_model(tokenizer, loaded, default_cache):
    """bench --workload lora --adapters N: request i on adapter i % N, adapters made once and found again, and
    paged_hf_base serving the same requests on the base model."""
    workload = build_workload("lora", tokenizer, num_requests=4, max_new_tokens_scale=0.05, num_adapters=2)
    assert [r.adapter for r in workload.requests] == ["lora_0", "lora_1", "lora_0", "lora_1"]
    assert parse_systems(None, "lora", scaling_adapters=True) == ["paged_hf", "paged_hf_base"]
    folders = random_adapters(None, 2, rank=4)
    assert random_adapters(None, 2, rank=4) == folders and all((Path(f) / "adapter_config.json").exists()
                                                                for f in folders.values())
    config = sized_engine_config({"adapters": folders, "max_loras": 2, "max_lora_rank": 4}, workload)
    with_adapters = run_system("paged_hf", *loaded, workload, config)
    base = run_system("paged_hf_base", *loaded, workload, config)
    assert with_adapters.error is None and base.error is None
    assert with_adapters.outputs != base.outputs  # the adapters were used, and only in paged_hf
    # --max-cpu-loras: the same adapters served from their folders by name, one place in host memory
    root = str(Path(folders["lora_0"]).parent)
    from_root = run_system("paged_hf", *loaded, workload, dict(config, adapters={}, lora_root=root, max_cpu_loras=1))
    assert from_root.error is None and from_root.outputs == with_adapters.outputs


def test_lora_workload_on_random_adapters_may_have_more_requests(tokenizer):
    """bench --adapters 1000 --random-adapters --requests 70: seeded random adapters, beyond the 64 mixed ones."""
    workload = build_workload("lora", tokenizer, num_requests=70, num_adapters=1000, random_adapters=True)
    again = build_workload("lora", tokenizer, num_requests=70, num_adapters=1000, random_adapters=True)
    adapters = [r.adapter for r in workload.requests]
    assert len(adapters) == 70 and adapters == [r.adapter for r in again.requests]
    assert 50 < len(set(adapters)) < 70 and all(0 <= int(a.removeprefix("lora_")) < 1000 for a in adapters)


def test_vllm_system_is_skipped_clearly_without_its_interpreter(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no .venv-vllm here
    assert vllm_system.default_vllm_python() is None
    mixed = Workload("mixed", "", 0, [BenchRequest([1], 1)])
    run = vllm_system.run_vllm(mixed, None, None, "bfloat16", None)
    assert run.skipped and "make bench-vllm" in run.skipped and "--vllm-python" in run.skipped
    assert "does not exist" in vllm_system.run_vllm(mixed, None, None, "bfloat16", str(tmp_path / "python")).skipped
    lora = Workload("lora", "", 0, [BenchRequest([1], 1, "lora_a")])
    assert "adapters" in vllm_system.skip_reason(sys.executable, lora, "cpu")
    (tmp_path / ".venv-vllm" / "bin").mkdir(parents=True)
    (tmp_path / ".venv-vllm" / "bin" / "python").touch()
    assert vllm_system.default_vllm_python() == str(Path(".venv-vllm/bin/python"))
    assert vllm_system.skip_reason(vllm_system.default_vllm_python(), mixed, "cpu") is None


# --- machine limit and report arithmetic ----------------------------------------------------------------------

def tiny_shape() -> machine.ModelShape:
    return machine.ModelShape(num_layers=2, hidden_size=4, num_heads=2, head_dim=2, linear_shapes=[(4, 8), (8, 4)],
                              lm_head_shape=(4, 10), num_params=100, weight_bytes=400)


def test_workload_flops_count_every_token_once_and_shared_prefixes_once_when_asked():
    workload = Workload("t", "", 0, [BenchRequest([1, 2, 3], 2), BenchRequest([1, 2, 9], 1)])
    flops = machine.workload_flops(tiny_shape(), workload)
    # request 0 processes 3 + 2 - 1 = 4 tokens (contexts 1..4), request 1 processes 3 (contexts 1..3)
    assert flops["num_tokens"] == 7
    assert flops["linear"] == 2 * (32 + 32) * 7
    assert flops["attention"] == 4 * 2 * 2 * 2 * (10 + 6)
    assert flops["lm_head"] == 2 * 40 * 3
    shared = machine.workload_flops(tiny_shape(), workload, prefix_once=True)
    assert shared["num_tokens"] == 5  # request 1 shares [1, 2]: only its last prompt token is computed
    assert shared["attention"] == 4 * 2 * 2 * 2 * (10 + 6 - 3)
    rates = {"matmul_flops_mlp": 1e3, "matmul_flops_lm_head": 1e2, "read_bandwidth_bytes_per_s": 400.0}
    result = machine.limit(tiny_shape(), workload, rates)
    assert result["compute_s"] == pytest.approx((flops["linear"] + flops["attention"]) / 1e3 + flops["lm_head"] / 1e2)
    assert result["bandwidth_s"] == pytest.approx(2 * 400 / 400.0)  # two sequential steps, all weights each
    assert result["min_time_s"] == max(result["compute_s"], result["bandwidth_s"])


def test_machine_measures_positive_rates():
    shape = machine.ModelShape(2, 32, 2, 16, [(32, 64)], (32, 128), 10_000, 40_000)
    for dtype in ("float32", "bfloat16"):  # the limit is measured in the dtype the systems run
        rates = machine.measure(shape, rows=16, min_seconds=0.01, dtype=dtype)
        assert rates["dtype"] == dtype and all(rates[k] > 0 for k in rates if k.startswith(("matmul_flops", "copy_", "read_")))


def test_step_weight_bytes_counts_each_storage_once_at_its_served_size():
    import paged_hf  # noqa: PLC0415
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    def model(tied: bool):
        config = LlamaConfig(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
        torch.manual_seed(0)
        return LlamaForCausalLM(config).to(torch.bfloat16).eval()

    untied, tied = model(False), model(True)
    table = 300 * 128 * 2
    rotary = {b.untyped_storage().data_ptr(): b.untyped_storage().nbytes() for b in untied.buffers()}
    all_bytes = sum(p.numel() * 2 for p in untied.parameters()) + sum(rotary.values())
    assert machine.step_weight_bytes(untied) == all_bytes - table  # a step reads a row of the input table
    assert machine.step_weight_bytes(tied) == all_bytes - table  # tied: the table counted once, as the lm_head
    quantized = paged_hf.wrap(model(True), quantization="int8")
    quantized.generator.generate([[1, 2, 3]], paged_hf.SamplingParams(max_new_tokens=2, temperature=0),
                                 use_tqdm=False)  # a step: q/k/v and gate/up stacked, sharing their linears' bytes
    linears = all_bytes - 2 * table - sum(p.numel() * 2 for n, p in untied.named_parameters() if "norm" in n)
    int8_linears = machine.step_weight_bytes(quantized) - table - (all_bytes - 2 * table - linears)
    assert 0.5 * linears < int8_linears < 0.53 * linears  # int8 weights + a float32 scale per output channel


def test_report_sets_one_request_decode_against_the_read_bandwidth():
    workload = Workload("decode", "", 0, [BenchRequest([5, 6], 4)])
    runs = {"paged_hf": SystemRun("paged_hf", 2.0, [[1, 2, 3, 4]], [0.1], [0.01], 10**9,
                                  extra={"step_weight_bytes": 3e9}),
            "paged_hf_int8": SystemRun("paged_hf_int8", 1.0, [[1, 2, 3, 4]], [0.1], [0.01], 10**9,
                                       extra={"step_weight_bytes": 2e9})}
    limit = {"rates": {"read_bandwidth_bytes_per_s": 16e9}, "min_time_s": 1.0, "min_time_prefix_once_s": 1.0}
    line = report_module.weights_moved_line(build_report(workload, runs, limit, {}))
    assert line == ("weights read a token: paged_hf 3.00 GB x 2.0 tok/s = 6.0 GB/s (38% of read); paged_hf_int8 "
                    "2.00 GB x 4.0 tok/s = 8.0 GB/s (50% of read)")
    two = Workload("decode", "", 0, [BenchRequest([5, 6], 4)] * 2)  # batched steps read the weights for several
    runs = {n: SystemRun(n, r.wall_s, r.outputs * 2, r.ttft_s * 2, r.tpot_s * 2, extra=r.extra)
            for n, r in runs.items()}
    assert report_module.weights_moved_line(build_report(two, runs, limit, {})) is None


def test_median_run_is_the_middle_wall_time_and_keeps_every_round():
    runs = [SystemRun("paged_hf", wall_s=wall) for wall in (30.0, 10.0, 20.0)]
    chosen = median_run(runs)
    assert chosen.wall_s == 20.0 and chosen.extra["rounds_wall_s"] == [30.0, 10.0, 20.0]
    assert median_run(runs[:2]).wall_s == 10.0  # an even count: the lower middle (the faster run)
    skipped = SystemRun("vllm", skipped="skipped: no interpreter")
    assert median_run([skipped]) is skipped


def test_report_counts_only_useful_tokens_and_compares_outputs():
    workload = Workload("t", "", 0, [BenchRequest([5, 6], 2), BenchRequest([7], 3)])
    runs = {
        "paged_hf": SystemRun("paged_hf", 1.0, [[1, 2], [3, 4, 5]], [0.1, 0.2], [0.01, 0.02], 2_000_000_000),
        # a static batch generates the longest request's length for everyone; the extra tokens are not useful
        "hf_static_8": SystemRun("hf_static_8", 2.5, [[1, 2, 9], [3, 4, 6]], [0.3, 0.3], [0.05, 0.05], 10**9),
        "hf_cb": SystemRun("hf_cb", skipped="skipped: not today"),
    }
    report = build_report(workload, runs, None, {})
    paged, static = report["systems"]["paged_hf"], report["systems"]["hf_static_8"]
    assert report["reference_system"] == "hf_static_8"
    assert paged["useful_tokens"] == static["useful_tokens"] == 5
    assert paged["tokens_per_s"] == 5.0 and static["paged_hf_speedup"] == pytest.approx(2.5)
    assert paged["outputs_vs_reference"]["identical"] == 1
    assert paged["outputs_vs_reference"]["mismatches"] == [{"request": 1, "first_difference": 2}]
    table = format_table(report)
    assert "hf_static_8" in table and "2.50x" in table and "1/2" in table and "skipped: not today" in table
    assert percentile([3, 1, 2], 50) == 2 and percentile([None], 50) is None


# --- the command line -----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_cli_generate_runs_a_jsonl_file(tmp_path, default_cache, loaded, capsys):
    model, tokenizer = loaded
    question = [{"role": "user", "content": "What is the capital of France?"}]
    requests = tmp_path / "in.jsonl"
    requests.write_text(json.dumps({"prompt": "The capital of France is", "max_new_tokens": 4}) + "\n\n"
                        + json.dumps({"messages": question, "id": "q2", "max_new_tokens": 6, "seed": 3}) + "\n")
    out = tmp_path / "out.jsonl"
    assert cli.main(["generate", str(requests), "-o", str(out), "--temperature", "0", "--quiet",
                     "--num-blocks", "32"]) == 0
    first, second = [json.loads(line) for line in out.read_text().splitlines()]
    assert first["id"] == 1 and len(first["token_ids"]) == 4 and first["finish_reason"] == "length"
    prompt = tokenizer.apply_chat_template(question, add_generation_prompt=True, tokenize=True, return_dict=False)
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt):].tolist()
    assert second["id"] == "q2" and second["token_ids"] == expected and "Paris" in second["text"]

    requests.write_text('{"prompt": "hi", "temperature": -1}\n')
    assert cli.main(["generate", str(requests)]) == 2
    assert "line 1" in capsys.readouterr().err


def _entry_point() -> list[str]:
    script = shutil.which("paged-hf", path=str(Path(sys.executable).parent))
    return [script] if script else [sys.executable, "-m", "paged_hf"]


@pytest.mark.slow
def test_bench_smoke_through_the_entry_point(tmp_path, default_cache):
    systems = ["paged_hf", "hf_static_8", "hf_cb"]
    command = [*_entry_point(), "bench", "--workload", "decode", "--requests", "4", "--max-new-tokens-scale", "0.02",
               "--systems", ",".join(systems), "--out", str(tmp_path), "--threads", "1", "--rounds", "2"]
    start = time.perf_counter()
    proc = subprocess.run(command, check=False, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, PAGED_HF_CACHE=str(default_cache)))
    print(f"\n[bench smoke] {time.perf_counter() - start:.1f} s\n{proc.stdout}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((tmp_path / "bench_decode.json").read_text())
    assert (tmp_path / "bench_decode.png").stat().st_size > 0
    assert report["workload"]["num_requests"] == 4 and report["reference_system"] == "hf_static_8"
    for name in systems:
        metrics = report["systems"][name]
        assert metrics["tokens_per_s"] > 0 and metrics["peak_rss_bytes"] > 0, (name, metrics)
        assert 0 <= metrics["outputs_vs_reference"]["identical"] <= 4
    assert report["systems"]["paged_hf"]["outputs_vs_reference"]["identical"] == 4  # exact greedy parity
    assert report["machine"]["min_time_s"] > 0 and 0 < report["paged_hf_fraction_of_limit"]
    assert "paged_hf" in proc.stdout and "identical" in proc.stdout
    for name in systems:  # --rounds 2: each system ran twice, taking turns; the table shows the median run
        walls = report["systems"][name]["extra"]["rounds_wall_s"]
        assert len(walls) == 2 and report["systems"][name]["wall_s"] == min(walls)
    assert "rounds (systems taking turns" in proc.stdout


@pytest.mark.slow
def test_structured_workload_enforces_half_the_schemas_with_equal_work(tokenizer):
    workload = build_workload("structured", tokenizer, num_requests=4, max_new_tokens_scale=0.1)
    assert [r.schema is not None for r in workload.requests] == [False, True, False, True]
    decode = build_workload("decode", tokenizer, num_requests=4)
    assert [r.prompt_token_ids for r in workload.requests] == [r.prompt_token_ids for r in decode.requests]
    assert Workload.from_json(json.loads(json.dumps(workload.to_json()))) == workload
    assert parse_systems(None, "structured") == ["paged_hf", "paged_hf_noschema"]
    model = tiny_model_for(tokenizer)  # tiny, with the real tokenizer
    engine = sized_engine_config({}, workload)
    enforced = run_system("paged_hf", model, tokenizer, workload, engine)
    plain = run_system("paged_hf_noschema", model, tokenizer, workload, engine)
    assert useful_tokens(enforced, workload) == useful_tokens(plain, workload) == workload.num_new_tokens
    texts = [tokenizer.decode(out) for out in enforced.outputs]
    assert all(texts[i].startswith('{"topic": "') for i in (1, 3)) and enforced.outputs[0] == plain.outputs[0]
    assert not any(tokenizer.decode(out).startswith('{"topic": "') for out in plain.outputs)



def test_bench_profile_splits_a_decode_and_a_mixed_step(tmp_path, capsys):
    """`bench --profile` on a tiny model folder: every category of both steps, shares summing to 100%, and the
    attention and matmul kernels seen (their ranges and ops are in the trace)."""
    from serve_process import save_tiny_model  # noqa: PLC0415

    folder = save_tiny_model(tmp_path / "model")
    assert cli.main(["bench", "--profile", "--model", folder, "--profile-seqs", "4", "--num-blocks", "256"]) == 0
    table = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line.split("|")[2:4] for line in table.splitlines()
            if line.startswith("| ") and "%" in line}
    assert set(rows) == {"matmuls", "attention", "other ops", "python: schedule", "python: step_inputs",
                         "python: model", "python: sample_and_stop", "python: rest of the step", "idle"}
    for column in range(2):
        shares = [float(cells[column].strip().rstrip("%")) for cells in rows.values()]
        assert abs(sum(shares) - 100) < 0.5
    assert float(rows["attention"][0].strip().rstrip("%")) > 0 and float(rows["matmuls"][0].strip().rstrip("%")) > 0
    without = re.findall(r"(decode|mixed) ([\d.]+)% of the step without the profiler \(([\d.]+) ms\)", table)
    assert [kind for kind, _, _ in without] == ["decode", "mixed"], table
    assert all(0 < float(share) <= 100 and float(ms) > 0 for _, share, ms in without), table
