"""The systems under test, each run in a fresh process on the same workload and model.

Why a process per system: peak RSS is a per-process high-water mark, and warm allocator pools, caches and
thread pools of one system would flatter (or burden) the next. So the parent writes a spec file and starts
``python -m paged_hf bench --_worker SPEC``; the worker loads the model itself, warms the system up on a tiny
request, runs the timed workload once and writes a JSON result.

Every system gets the same requests in the same (arrival) order, generates greedily, ignores EOS, and
returns each request's own ``max_new_tokens`` tokens, so outputs can be compared token for token.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict

import torch
from transformers import StoppingCriteriaList

import paged_hf
from paged_hf import BeamSearchParams, SamplingParams
from paged_hf.bench.documents import DOCUMENT_SYSTEMS, KV_HOST_GIB, KV_HOST_SYSTEM, generate_in_waves
from paged_hf.bench.machine import peak_rss_bytes, step_weight_bytes
from paged_hf.bench.pipeline import PIPELINE_SYSTEMS, is_pipeline_system, run_pipeline
from paged_hf.bench.system_run import SystemRun, time_per_output_token, warmup_ids
from paged_hf.bench.workloads import Workload
from paged_hf.loader import default_model

#: paged_hf with a quantized KV cache (PagedConfig.kv_cache_dtype): `paged_hf_kv_<dtype>`
KV_SYSTEMS = {"paged_hf_kv_int8": "int8", "paged_hf_kv_fp8_e4m3": "fp8_e4m3", "paged_hf_kv_fp8_e5m2": "fp8_e5m2"}
#: paged_hf with the model's linears quantized at load (PagedConfig.quantization, docs/quantization.md)
QUANT_SYSTEMS = {"paged_hf_int8": "int8", "paged_hf_w4a16": "w4a16"}
#: paged_hf writing every computed KV block through to a fresh --kv-cache-dir: the tier's cost when never hit
KV_DISK_SYSTEM = "paged_hf_kvdisk"
PAGED_SYSTEMS = ("paged_hf", "paged_hf_base", "paged_hf_noprefix", "paged_hf_noschema", "paged_hf_spec", *KV_SYSTEMS,
                 KV_DISK_SYSTEM, KV_HOST_SYSTEM, *QUANT_SYSTEMS)
SYSTEM_NAMES = (*PAGED_SYSTEMS, *PIPELINE_SYSTEMS, "vllm", "hf_static_8", "hf_static_32", "hf_single", "hf_cb", "hf_cb_default")
#: `vllm` runs in its own interpreter (see .vllm_system); without one it is reported as skipped
DEFAULT_SYSTEMS = {
    "mixed": ("paged_hf", "vllm", "hf_static_8", "hf_static_32", "hf_single", "hf_cb"),
    "prefix": ("paged_hf", "paged_hf_noprefix", "vllm", "hf_static_8", "hf_cb"),
    "decode": ("paged_hf", "vllm", "hf_static_8", "hf_static_32", "hf_cb"),
    "lora": ("paged_hf", "hf_static_8"),  # with --adapters N: paged_hf, paged_hf_base (LORA_SCALE_SYSTEMS)
    "structured": ("paged_hf", "paged_hf_noschema"),  # JSON schemas enforced, and the same batch without
    "beam": ("paged_hf", "hf_static_8", "hf_single"),  # HF generate(num_beams=k), 8 prompts a batch or one
    "grounded": ("paged_hf", "paged_hf_spec"),  # the same engine without and with speculative decoding
    "documents": DOCUMENT_SYSTEMS,  # the same engine without a KV tier, with host memory, with a directory
}
#: `bench --workload lora --adapters N`: the adapters' cost, paged_hf beside the same engine on the same requests
#: with no adapter (paged_hf_base)
LORA_SCALE_SYSTEMS = ("paged_hf", "paged_hf_base")
#: paged_hf_spec's speculative config unless --speculative-config gives one (the other paged_hf systems never
#: speculate, so one invocation compares the same engine with and without)
DEFAULT_SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 16, "prompt_lookup_min": 1, "prompt_lookup_max": 16}
#: transformers' continuous batching: `hf_cb` as tuned in MEASUREMENTS.md, `hf_cb_default` with transformers'
#: own defaults (the configuration of issue 5's 20.9 tok/s; on CPU it is slower and uses 6-12 GB).
HF_CB_CONFIGS = {"hf_cb": {"max_batch_tokens": 512, "max_requests_per_batch": 8, "num_blocks": 128},
                 "hf_cb_default": {}}


# --- running one system (inside the worker) -------------------------------------------------------------------

def run_paged_hf(model, tokenizer, workload: Workload, engine_config: dict, enable_prefix_caching=True,
                 enforce_schemas=True, name: str | None = None) -> SystemRun:
    """paged_hf through its public API: wrap() once, then one generator.generate() call for the whole workload.
    `name` one of KV_SYSTEMS: with that kv_cache_dtype; "paged_hf_spec": with speculative decoding;
    "paged_hf_base": every request on the base model (the workload's adapters loaded but not used);
    KV_DISK_SYSTEM: the KV tier on disk, in a fresh folder."""
    name = name or ("paged_hf_noschema" if not enforce_schemas else "paged_hf" if enable_prefix_caching else
                    "paged_hf_noprefix")
    config = dict(engine_config, enable_prefix_caching=enable_prefix_caching and engine_config.get(
        "enable_prefix_caching", True))
    config["kv_cache_dtype"] = KV_SYSTEMS.get(name, config.get("kv_cache_dtype", "auto"))
    config["quantization"] = QUANT_SYSTEMS.get(name, config.get("quantization"))
    if name == KV_DISK_SYSTEM:  # a fresh folder: nothing to hit; removed at exit, after the tier's writes are flushed
        config["kv_cache_dir"] = tempfile.mkdtemp(prefix="paged_hf_bench_kvdisk_")
        atexit.register(shutil.rmtree, config["kv_cache_dir"], True)
    if name == KV_HOST_SYSTEM:
        config["kv_offloading_size"] = config.get("kv_offloading_size") or KV_HOST_GIB
    speculate = name == "paged_hf_spec"
    config["speculative"] = (engine_config.get("speculative") or DEFAULT_SPECULATIVE) if speculate else None
    generator = paged_hf.wrap(model, tokenizer, **config).generator
    generator.generate([warmup_ids(tokenizer)], SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True),
                       use_tqdm=False)
    params = [SamplingParams(max_new_tokens=r.max_new_tokens, temperature=0, ignore_eos=True,
                             structured_outputs={"json": r.schema} if r.schema and enforce_schemas else None)
              for r in workload.requests]
    adapters = [r.adapter for r in workload.requests] if workload.needs_adapters and name != "paged_hf_base" else None
    if workload.num_beams > 1:
        return _run_paged_beams(generator, workload, name, config)
    before = generator.stats()
    start = time.perf_counter()
    outputs = generate_in_waves(generator, workload, params, adapters)  # one generate() call per wave
    wall = time.perf_counter() - start
    if generator.runner.kv_tier is not None:  # every write of the run counted (flushed after the wall: they overlap)
        generator.runner.kv_tier.flush()
    after = generator.stats()
    ttft, tpot = [], []
    for out in outputs:
        m, n = out.metrics, len(out.outputs[0].token_ids)
        ttft.append(m.first_token_time - m.arrival_time)
        tpot.append(time_per_output_token(m.first_token_time, m.finish_time, n))
    extra = {key: after[key] - before[key] for key in ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions")}
    if speculate:
        extra["spec_decode"] = spec_decode_delta(before, after)
    extra.update(num_blocks=after["num_blocks"], max_num_running=after.get("max_num_running"))
    extra["kv_cache_dtype"] = config.get("kv_cache_dtype", "auto")
    extra["step_weight_bytes"] = step_weight_bytes(model)  # quantized at load: the bytes as served
    extra["engine_config"] = config
    if "kv_tier_bytes_written" in after:  # the KV tier: what was written through, read back, dropped
        extra["kv_tier"] = {key: after[key] for key in after if key.startswith("kv_tier_")}
    if "lora_loads" in after:  # the adapter store: folders read, and how long requests waited for them
        extra["lora"] = {key: after[key] for key in ("lora_loads", "lora_load_seconds_p50", "lora_load_seconds_p99",
                                                     "lora_wait_seconds_p99", "lora_in_memory", "lora_in_slots")}
    return SystemRun(name, wall, [list(o.outputs[0].token_ids) for o in outputs], ttft, tpot, extra=extra)


def spec_decode_delta(before: dict, after: dict) -> dict:
    """The speculation counters of the timed run alone (the warm-up's taken out)."""
    delta = {key: after[key] - before[key] for key in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                                                       "spec_decode_num_accepted_tokens")}
    delta["spec_decode_num_accepted_tokens_per_pos"] = [
        a - b for a, b in zip(after["spec_decode_num_accepted_tokens_per_pos"],
                              before["spec_decode_num_accepted_tokens_per_pos"])]
    drafted = delta["spec_decode_num_draft_tokens"]
    delta["spec_decode_acceptance_rate"] = delta["spec_decode_num_accepted_tokens"] / drafted if drafted else 0.0
    return delta


def _run_paged_beams(generator, workload: Workload, name: str, config: dict) -> SystemRun:
    """The beam workload through `generator.beam_search` (one call, every prompt's beams batched together)."""
    params = [BeamSearchParams(beam_width=workload.num_beams, max_tokens=r.max_new_tokens, ignore_eos=True,
                               num_return_sequences=1) for r in workload.requests]
    start = time.perf_counter()
    outputs = generator.beam_search([r.prompt_token_ids for r in workload.requests], params)
    wall = time.perf_counter() - start
    extra = {"num_blocks": generator.stats()["num_blocks"], "engine_config": config,
             "num_block_copies": generator.kv_cache_manager.num_block_copies}
    return SystemRun(name, wall, [o.sequences[0].output_token_ids for o in outputs], extra=extra)


def skip_reason(system: str, workload: Workload, engine_config: dict) -> str | None:
    """Why ``system`` cannot run ``workload`` at all (checked before a worker is started), or None."""
    if workload.num_beams > 1 and system in HF_CB_CONFIGS:
        return "skipped: transformers' continuous batching has no beam search"
    if not workload.needs_adapters:
        return None
    if system in HF_CB_CONFIGS:
        return "skipped: transformers' continuous batching has no per-request LoRA adapters"
    return _lora_unavailable(engine_config, {r.adapter for r in workload.requests if r.adapter},
                             check_engine=system.startswith("paged_hf"))


def _lora_unavailable(config: dict, names: set[str], check_engine: bool) -> str | None:
    root = config.get("lora_root")  # adapters served from their folders under it by name
    missing = sorted(name for name in names - set(config.get("adapters") or {})
                     if root is None or not os.path.isfile(os.path.join(root, name, "adapter_config.json")))
    if missing:
        return (f"skipped: the lora workload needs LoRA adapters {', '.join(missing)} (pass --adapter NAME=PATH "
                "for each) and an engine with LoRA support")
    if check_engine and not hasattr(paged_hf.ContinuousBatchGenerator, "load_adapter"):
        return "skipped: this paged_hf engine has no LoRA support yet (ContinuousBatchGenerator.load_adapter)"
    return None


class _StepClock:
    """A stopping criterion that never stops: it only timestamps every decoding step of HF generate, which is
    how the static baselines get per-request first-token and per-token times."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _hf_batch(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, clock=None, adapter_names=None,
              num_beams: int = 1):
    """HF generate on one left-padded batch, greedy, EOS neither stopping nor masked (as paged_hf's ignore_eos).
    ``adapter_names``: peft's mixed-adapter batch, one name per row. Returns the generated ids [batch, n]."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    criteria = StoppingCriteriaList([clock]) if clock is not None else None
    extra = {"adapter_names": adapter_names} if adapter_names is not None else {}
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=pad,
                             stopping_criteria=criteria, num_beams=num_beams, **extra)
    return out[:, width:]


def with_peft_adapters(model, adapters: dict[str, str]):
    """The model as a peft ``PeftModel`` holding every adapter: peft's own way to batch several adapters
    (``generate(..., adapter_names=[one per row])``, ``"__base__"`` for the base model)."""
    from peft import PeftModel  # noqa: PLC0415 - deliberately lazy: ~0.2 s to import, for the lora workload only

    (first, path), *rest = adapters.items()
    peft_model = PeftModel.from_pretrained(model, path, adapter_name=first)
    for name, path in rest:
        peft_model.load_adapter(path, adapter_name=name)
    return peft_model.eval()


def run_hf_static(model, tokenizer, workload: Workload, batch_size: int, name: str,
                  adapters: dict | None = None) -> SystemRun:
    """HF generate on batches in arrival order; a batch runs until its longest request is done. Only each
    request's own max_new_tokens count as useful; the rest of its row is padding work the batch had to do.
    The lora workload goes through peft's mixed-adapter batches."""
    if workload.needs_adapters:
        model = with_peft_adapters(model, adapters)
    _hf_batch(model, tokenizer, [warmup_ids(tokenizer)], 2,
              adapter_names=["__base__"] if workload.needs_adapters else None)
    requests = workload.requests
    outputs, ttft, tpot = [], [], []
    start = time.perf_counter()
    for first in range(0, len(requests), batch_size):
        batch = requests[first:first + batch_size]
        clock = _StepClock()
        names = [r.adapter or "__base__" for r in batch] if workload.needs_adapters else None
        generated = _hf_batch(model, tokenizer, [r.prompt_token_ids for r in batch],
                              max(r.max_new_tokens for r in batch), clock, names, workload.num_beams)
        for row, request in zip(generated.tolist(), batch):
            n = request.max_new_tokens
            outputs.append(row[:n])
            ttft.append(clock.times[0] - start)  # every request arrived at the start, as for the other systems
            tpot.append(time_per_output_token(clock.times[0], clock.times[n - 1], n))
    wall = time.perf_counter() - start
    return SystemRun(name, wall, outputs, ttft, tpot, extra={"batch_size": batch_size})


def run_hf_cb(model, tokenizer, workload: Workload, name: str = "hf_cb") -> SystemRun:
    """transformers' own continuous batching: its manager takes each request with its own max_new_tokens
    (``add_request(..., max_new_tokens=...)``; ``generate_batch`` only takes one for all) and eos_token_id=-1."""
    # transformers' newest API, for the hf_cb systems only: a transformers without it still runs every other command
    from transformers import ContinuousBatchingConfig, GenerationConfig  # noqa: PLC0415

    cb_config = dict(HF_CB_CONFIGS[name])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    generation_config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=pad, max_new_tokens=16)
    manager = model.init_continuous_batching(generation_config=generation_config,
                                             continuous_batching_config=ContinuousBatchingConfig(**cb_config))
    manager.start()
    try:
        _cb_collect(manager, [(warmup_ids(tokenizer), 2)], "warmup")
        jobs = [(r.prompt_token_ids, r.max_new_tokens) for r in workload.requests]
        start = time.perf_counter()
        results = _cb_collect(manager, jobs, "r")
        wall = time.perf_counter() - start
    finally:
        manager.stop(block=True, timeout=30)
    outputs, ttft, tpot = [], [], []
    for result in results:
        stamps = result.timestamps or []
        outputs.append(list(result.generated_tokens))
        ttft.append(stamps[0] - result.created_time if stamps else None)
        n = len(stamps)
        tpot.append(time_per_output_token(stamps[0] if stamps else None, stamps[-1] if stamps else None, n))
    return SystemRun(name, wall, outputs, ttft, tpot, extra={"cb_config": cb_config})


def _cb_collect(manager, jobs: list[tuple[list[int], int]], prefix: str, timeout_s: float = 3600.0) -> list:
    """Submit every (prompt, max_new_tokens) job and wait for all results, in submission order."""
    ids = [f"{prefix}{i}" for i in range(len(jobs))]
    for request_id, (prompt, max_new_tokens) in zip(ids, jobs):
        manager.add_request(prompt, request_id=request_id, max_new_tokens=max_new_tokens, record_timestamps=True,
                            eos_token_id=-1)
    results: dict = {}
    deadline = time.monotonic() + timeout_s
    while len(results) < len(ids):
        result = manager.get_result(timeout=1)
        if result is not None and result.is_finished():
            if result.error is not None:
                raise RuntimeError(f"transformers continuous batching failed request {result.request_id}: "
                                   f"{result.error}")
            results[result.request_id] = result
        elif result is None and (not manager.is_running() or time.monotonic() > deadline):
            raise RuntimeError(f"transformers continuous batching stopped with {len(ids) - len(results)} requests "
                               "unfinished")
    return [results[i] for i in ids]


def run_system(system: str, model, tokenizer, workload: Workload, engine_config: dict) -> SystemRun:
    reason = skip_reason(system, workload, engine_config)
    if reason:
        return SystemRun(system, skipped=reason)
    if system in PAGED_SYSTEMS:
        return run_paged_hf(model, tokenizer, workload, engine_config,
                            enable_prefix_caching=system != "paged_hf_noprefix",
                            enforce_schemas=system != "paged_hf_noschema", name=system)
    adapters = engine_config.get("adapters")
    if system.startswith("hf_static_"):
        return run_hf_static(model, tokenizer, workload, int(system.rsplit("_", 1)[1]), system, adapters)
    if system == "hf_single":
        return run_hf_static(model, tokenizer, workload, 1, system, adapters)
    if system in HF_CB_CONFIGS:
        return run_hf_cb(model, tokenizer, workload, system)
    raise ValueError(f"unknown system {system!r}; known: {', '.join(SYSTEM_NAMES)}")


# --- the worker process ---------------------------------------------------------------------------------------

def worker_main(spec_path: str) -> int:
    """Entry point of ``python -m paged_hf bench --_worker SPEC``: load, run one system, write its result."""
    with open(spec_path) as fh:
        spec = json.load(fh)
    system = spec["system"]
    try:
        if spec.get("threads"):
            torch.set_num_threads(spec["threads"])
        dtype, workload = getattr(torch, spec.get("dtype", "float32")), Workload.from_json(spec["workload"])
        if is_pipeline_system(system):  # its stages load their own layers
            run = run_pipeline(system, spec["model"], dtype, workload, spec["engine_config"])
        else:
            model, tokenizer = default_model.load_model(spec["model"], dtype, spec.get("device", "cpu"))
            run = run_system(system, model, tokenizer, workload, spec["engine_config"])
        run.num_threads = torch.get_num_threads()
        if torch.cuda.is_available() and str(spec.get("device", "cpu")).startswith("cuda"):
            run.extra["peak_gpu_memory_bytes"] = torch.cuda.max_memory_allocated()
    except Exception as exc:  # reported as that system's error; the other systems still run
        traceback.print_exc()
        run = SystemRun(system, error=f"{type(exc).__name__}: {exc}")
    run.peak_rss_bytes = peak_rss_bytes()
    with open(spec["result_path"], "w") as fh:
        json.dump(asdict(run), fh)
    return 0


def stderr_fd():
    """Our stderr's descriptor, so a worker's chatter never mixes into the table on stdout (None if it has none)."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def run_in_subprocess(system: str, workload: Workload, model: str | None, engine_config: dict, device: str = "cpu",
                      dtype: str = "float32", timeout_s: float | None = None, threads: int | None = None) -> SystemRun:
    """Run one system in a fresh Python process (its output goes to our stderr) and read back its result."""
    reason = skip_reason(system, workload, engine_config)
    if reason:
        return SystemRun(system, skipped=reason)
    with tempfile.TemporaryDirectory(prefix="paged_hf_bench_") as tmp:
        spec_path, result_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "result.json")
        spec = {"system": system, "model": model, "workload": workload.to_json(), "engine_config": engine_config,
                "device": device, "dtype": dtype, "threads": threads, "result_path": result_path}
        with open(spec_path, "w") as fh:
            json.dump(spec, fh)
        command = [sys.executable, "-m", "paged_hf", "bench", "--_worker", spec_path]
        try:
            proc = subprocess.run(command, stdout=stderr_fd(), timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            return SystemRun(system, error=f"timed out after {timeout_s} s")
        if not os.path.exists(result_path):
            return SystemRun(system, error=f"worker exited with code {proc.returncode} and no result")
        with open(result_path) as fh:
            return SystemRun(**json.load(fh))
