"""`paged-hf bench`: paged_hf side by side with HF's own ways of generating, on one workload and one model.

The parent process builds the workload (it needs only the tokenizer), runs every system in a fresh worker
process (see :mod:`.systems`), measures the machine's limit (:mod:`.machine`) while nothing else of ours runs,
and writes the table, the JSON (:mod:`.report`) and the plot with its figures block for the docs (:mod:`.plot`).
"""

from __future__ import annotations

import os
import shlex
import sys
import time

import torch
from transformers import AutoTokenizer

from paged_hf.bench import machine
from paged_hf.bench import plot as plotting
from paged_hf.bench import report as reporting
from paged_hf.bench.adapters import random_adapters
from paged_hf.bench.documents import build_documents_workload
from paged_hf.bench.embed import run_embed_bench
from paged_hf.bench.model_shapes import describe_shape, resolve_model_shape
from paged_hf.bench.pipeline import is_pipeline_system
from paged_hf.bench.systems import DEFAULT_SYSTEMS, LORA_SCALE_SYSTEMS, SYSTEM_NAMES, SystemRun, run_in_subprocess
from paged_hf.bench.tenants import run_tenants_bench
from paged_hf.bench.vision import run_vision_bench
from paged_hf.bench.vllm_system import default_vllm_python, run_vllm
from paged_hf.bench.workloads import WORKLOAD_NAMES, Workload, build_workload
from paged_hf.config.groups import CacheConfig
from paged_hf.loader.default_model import ensure_default_checkpoint, is_default_model
from paged_hf.utils import cdiv, cpu_model_name, describe_host

__all__ = ["DEFAULT_SYSTEMS", "SYSTEM_NAMES", "WORKLOAD_NAMES", "Workload", "build_workload", "median_run", "run_bench"]


def parse_systems(value: str | None, workload: str, scaling_adapters: bool = False) -> list[str]:
    if not value:
        return list(LORA_SCALE_SYSTEMS if scaling_adapters else DEFAULT_SYSTEMS[workload])
    systems = [s.strip() for s in value.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEM_NAMES and not is_pipeline_system(s)]
    if unknown:
        raise ValueError(f"unknown system(s) {unknown}; known: {', '.join(SYSTEM_NAMES)}")
    return list(dict.fromkeys(systems))


def sized_engine_config(engine_config: dict, workload: Workload) -> dict:
    """Without --num-blocks or --kv-cache-memory, give paged_hf a KV cache that holds the whole workload at
    once (plus the warm-up request): enough that nothing is preempted, and no more, so that its peak RSS is
    comparable with the baselines' (the engine's CPU default would reserve up to 4 GiB of zeros)."""
    if engine_config.get("num_blocks") or engine_config.get("kv_cache_memory"):
        return dict(engine_config)
    if workload.num_blocks:  # the workload sizes the pool itself (documents: a pool of a few documents)
        return dict(engine_config, num_blocks=workload.num_blocks)
    block_size = engine_config.get("block_size", CacheConfig.block_size)
    beams = workload.num_beams  # beams share their prompt's full blocks, each holds the rest itself
    needed = sum(len(r.prompt_token_ids) // block_size + beams * (cdiv(len(r.prompt_token_ids) + r.max_new_tokens,
                 block_size) - len(r.prompt_token_ids) // block_size) for r in workload.requests)
    return dict(engine_config, num_blocks=needed + 4)


def _with_random_adapters(args) -> dict:
    """The engine config, with --adapters N random rank --lora-rank adapters loaded (max_loras N unless given);
    with --max-cpu-loras they are served from their folders by name (a root), read on first use."""
    if args.adapters is None:
        return dict(args.engine_config)
    folders = random_adapters(args.model, args.adapters, args.lora_rank)
    config = dict(args.engine_config, max_loras=args.engine_config.get("max_loras") or args.adapters,
                  max_lora_rank=args.lora_rank)
    if config.get("max_cpu_loras") is not None:  # S-LoRA's case: registered under a root, read from disk on first use
        root = {os.path.dirname(folder) for folder in folders.values()}.pop()
        return dict(config, lora_root=root)
    return dict(config, adapters={**args.engine_config.get("adapters", {}), **folders})


class _OtherLoad:
    """How much of the machine other processes used while one system ran (0 = idle, 1 = every core busy).

    Why: on a shared machine a system that ran while someone else's job did is slower for no fault of its own.
    System-wide busy CPU time (psutil) minus our finished child's CPU time (getrusage) is everyone else's."""

    def __init__(self):
        self.start = self._sample()

    @staticmethod
    def _sample():
        try:  # optional: psutil is the bench extra's; resource is Unix-only
            import resource  # noqa: PLC0415

            import psutil  # noqa: PLC0415
        except ImportError:  # pragma: no cover - psutil is in the bench extra
            return None
        times = psutil.cpu_times()
        idle = times.idle + getattr(times, "iowait", 0.0)
        guest = getattr(times, "guest", 0.0) + getattr(times, "guest_nice", 0.0)  # Linux: already in user/nice
        busy = sum(times) - idle - guest
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        return time.perf_counter(), busy, children.ru_utime + children.ru_stime, psutil.cpu_count() or 1

    def fraction(self) -> float | None:
        end = self._sample()
        if self.start is None or end is None or end[0] <= self.start[0]:
            return None
        other = (end[1] - self.start[1]) - (end[2] - self.start[2])
        return max(0.0, other / ((end[0] - self.start[0]) * end[3]))


def _log(message: str) -> None:
    print(f"[paged-hf bench] {message}", file=sys.stderr, flush=True)


def _load_tokenizer(model: str | None):
    return AutoTokenizer.from_pretrained(ensure_default_checkpoint() if is_default_model(model) else model)


def _measure_limit(model: str | None, workload: Workload, device: str, dtype: str) -> dict | None:
    """The limit in the dtype the systems ran: its matmul rates, and its weight bytes for the bandwidth floor."""
    try:
        shape = machine.model_shape(model, getattr(torch, dtype).itemsize)
        return machine.limit(shape, workload, machine.measure(shape, device, dtype=dtype))
    except Exception as exc:  # the limit is context, not the benchmark: report and go on
        _log(f"could not measure the machine's limit: {type(exc).__name__}: {exc}")
        return None


def measured_where(args) -> dict:
    """The host (CPU model and flags, GPU), the command and the date: every report and plot names them, so that
    figures from two hosts are never compared as if they were one."""
    argv = getattr(args, "argv", None)
    return {"host": describe_host(), "cpu": cpu_model_name(), "date": time.strftime("%Y-%m-%d"),
            "num_threads": torch.get_num_threads(),
            "command": "paged-hf " + shlex.join(argv) if argv is not None else "paged-hf bench"}


def _run_system(args, system: str, workload: Workload, engine_config: dict, tokenizer, vllm_python: str) -> SystemRun:
    """One system, in a fresh process, with how busy other processes kept the machine meanwhile."""
    _log(f"running {system} in a fresh process ...")
    start, other_load = time.perf_counter(), _OtherLoad()
    if system == "vllm":
        run = run_vllm(workload, args.model, tokenizer, args.dtype, vllm_python, args.device, args.system_timeout,
                       args.threads)
    else:
        run = run_in_subprocess(system, workload, args.model, engine_config, args.device, args.dtype,
                                args.system_timeout, args.threads)
    run.extra["other_cpu_load"] = other_load.fraction()
    status = run.skipped or run.error or f"{run.wall_s:.1f} s timed"
    _log(f"{system}: {status} ({time.perf_counter() - start:.1f} s with start-up)")
    return run


def _run_rounds(args, systems: list[str], workload: Workload, engine_config: dict, tokenizer,
                vllm_python: str) -> dict[str, SystemRun]:
    """Every system `--rounds` times, taking turns (A B A B ...), so that a slow spell of a shared machine falls on
    all of them alike -> each system's median run by wall time, with every round's wall time in its extra. A
    system that was skipped or failed is not run again."""
    rounds: dict[str, list[SystemRun]] = {system: [] for system in systems}
    num_rounds = max(1, getattr(args, "rounds", 1) or 1)
    for number in range(num_rounds):
        if num_rounds > 1:
            _log(f"round {number + 1} of {num_rounds}")
        for system in systems:
            if rounds[system] and (rounds[system][0].skipped or rounds[system][0].error):
                continue
            rounds[system].append(_run_system(args, system, workload, engine_config, tokenizer, vllm_python))
    return {system: median_run(runs) for system, runs in rounds.items()}


def median_run(runs: list[SystemRun]) -> SystemRun:
    """The run of median wall time (the lower middle of an even count), every run's wall time in its extra."""
    if len(runs) == 1 or runs[0].wall_s is None:
        return runs[0]
    ordered = sorted(runs, key=lambda run: run.wall_s)
    chosen = ordered[(len(ordered) - 1) // 2]
    chosen.extra["rounds_wall_s"] = [run.wall_s for run in runs]
    return chosen


def run_bench(args) -> int:
    """Run the benchmark described by the parsed ``paged-hf bench`` arguments; 0 if every system ran (or was
    skipped on purpose), 1 if any failed."""
    if args.workload == "vision":  # images and a question against HF's generate, in this process
        return run_vision_bench(args)
    if args.workload == "embed":  # texts/s of embeddings against sentence-transformers
        if getattr(args, "model_shape", None):
            raise ValueError("--model-shape builds a generative model; --workload embed measures embeddings")
        return run_embed_bench(args)
    model_shape = resolve_model_shape(args)  # --model-shape: args.model becomes its folder, built once
    if args.workload == "tenants":  # timed arrivals of two tenants under each scheduling policy
        return run_tenants_bench(args)
    tokenizer = _load_tokenizer(args.model)
    num_adapters = args.adapters
    if args.workload == "documents":  # --requests N: the first N documents
        workload = build_documents_workload(tokenizer, args.seed, args.requests, args.max_new_tokens_scale)
    else:
        workload = build_workload(args.workload, tokenizer, args.seed, args.requests, args.max_new_tokens_scale,
                                  num_adapters, args.random_adapters)
    systems = parse_systems(args.systems, args.workload, scaling_adapters=num_adapters is not None)
    engine_config = sized_engine_config(_with_random_adapters(args), workload)
    summary = workload.summary()
    _log(f"workload {workload.name}: {summary['num_requests']} requests, {summary['prompt_tokens']} prompt + "
         f"{summary['new_tokens']} new tokens; systems: {', '.join(systems)}")
    vllm_python = getattr(args, "vllm_python", None) or default_vllm_python()
    runs = _run_rounds(args, systems, workload, engine_config, tokenizer, vllm_python)
    if args.threads:
        torch.set_num_threads(args.threads)
    limit = None if args.no_machine_limit else _measure_limit(args.model, workload, args.device, args.dtype)
    model_name = describe_shape(model_shape) if model_shape else args.model or "SmolLM2-135M-Instruct (default)"
    settings = {"model": model_name, "model_shape": model_shape, "device": args.device, "dtype": args.dtype,
                "threads": args.threads, "vllm_python": vllm_python if "vllm" in systems else None,
                "engine_config": engine_config, "systems": systems,
                "max_new_tokens_scale": args.max_new_tokens_scale, **measured_where(args)}
    report = reporting.build_report(workload, runs, limit, settings)
    print(reporting.format_table(report), flush=True)
    if args.out:
        _log(f"wrote {reporting.write_json(report, args.out)}")
        plot = plotting.write_plot(report, args.out)
        if plot:
            _log(f"wrote {plot} and {plotting.write_figures_block(report, args.out)}")
    return 1 if any(run.error for run in runs.values()) else 0
