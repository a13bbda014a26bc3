"""`paged_hf_pp<N>` and `paged_hf_pp<N>_serial`: the engine as a pipeline of N stages, each on one core.

The worker process is stage 0 and spawns the others (paged_hf.llm_stages); stage i is pinned to the i-th core this
process may run on, with one torch thread, so the stages compute at once only where micro-batches overlap.
`paged_hf_pp<N>` keeps one micro-batch in flight per stage (the default); `paged_hf_pp<N>_serial` one batch at a
time through all stages: the ratio of the two is what the micro-batches buy. The result records each stage's
weights, KV blocks and resident memory, beside the one-process `paged_hf`'s.
"""

from __future__ import annotations

import os
import re
import time
from functools import partial

import torch

from paged_hf import SamplingParams
from paged_hf.bench.system_run import SystemRun, time_per_output_token, warmup_ids
from paged_hf.bench.workloads import Workload
from paged_hf.llm_stages import PipelineStages, load_stage_model, stage_generator

_NAME = re.compile(r"^paged_hf_pp(?P<stages>[2-9])(?P<serial>_serial)?$")
PIPELINE_SYSTEMS = ("paged_hf_pp2", "paged_hf_pp2_serial")  # listed in --help; any paged_hf_pp<N>[_serial] runs


def is_pipeline_system(name: str) -> bool:
    return _NAME.match(name) is not None


def run_pipeline(name: str, model: str | None, dtype: torch.dtype, workload: Workload,
                 engine_config: dict) -> SystemRun:
    """-> a SystemRun of the workload through the pipeline (one generate() call, as `paged_hf`)."""
    match = _NAME.match(name)
    stages = int(match["stages"])
    config = dict(engine_config, pipeline_batches_in_flight=1 if match["serial"] else None)
    cores = sorted(os.sched_getaffinity(0))
    pipeline = PipelineStages(stages, partial(_pinned_stage, model, dtype, cores), partial(stage_generator, config))
    try:
        warmup = SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True)
        pipeline.call("generate", [warmup_ids(pipeline.tokenizer)], warmup, use_tqdm=False)
        params = [SamplingParams(max_new_tokens=r.max_new_tokens, temperature=0, ignore_eos=True)
                  for r in workload.requests]
        adapters = [r.adapter for r in workload.requests] if workload.needs_adapters else None
        start = time.perf_counter()
        outputs = pipeline.call("generate", [r.prompt_token_ids for r in workload.requests], params, adapters=adapters,
                                use_tqdm=False)
        wall = time.perf_counter() - start
        extra = {"memory": _stage_memory(pipeline), "pinned_cores": cores[:stages],
                 "batches_in_flight": pipeline.generator.engine_step.depth,
                 "num_preemptions": pipeline.generator.scheduler.num_preemptions}
    finally:
        pipeline.close()
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outputs]
    tpot = [time_per_output_token(o.metrics.first_token_time, o.metrics.finish_time, len(o.outputs[0].token_ids))
            for o in outputs]
    return SystemRun(name, wall, [list(o.outputs[0].token_ids) for o in outputs], ttft, tpot, extra=extra)


def _pinned_stage(model: str | None, dtype: torch.dtype, cores: list[int], stage: int, count: int):
    os.sched_setaffinity(0, {cores[stage % len(cores)]})
    torch.set_num_threads(1)
    return load_stage_model(model, dtype, "cpu", stage, count)


def _stage_memory(pipeline: PipelineStages) -> dict:
    """Stage 0's layers, weights and KV blocks (the others hold their own split); every stage's resident memory."""
    import psutil  # noqa: PLC0415 - the bench extra

    cache = pipeline.generator.runner.cache
    stage = pipeline.model.pipeline_stage
    pids = [os.getpid()] + [p.pid for p in pipeline.processes]
    return {"stage0_layers": [stage.start, stage.end], "num_layers": stage.num_layers,
            "stage0_weight_bytes": sum(p.numel() * p.element_size() for p in pipeline.model.parameters()),
            "stage0_kv_cache_bytes": sum(t.numel() * t.element_size() for t in cache.key_cache + cache.value_cache),
            "num_blocks": pipeline.generator.block_pool.num_blocks,
            "rss_bytes": [psutil.Process(pid).memory_info().rss for pid in pids]}
