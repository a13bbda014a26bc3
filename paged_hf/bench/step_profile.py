"""`paged-hf bench --profile`: where one engine step's wall time goes on this CPU.

Two kinds of step, each profiled over a few steps with torch.profiler (CPU): a decode step of `--profile-seqs`
sequences (64 by default, each past a 64-token prompt), and a mixed step (the same decodes and a 512-token
prompt's chunk). The main thread's time is split by the trace:
- matmuls: the self time of matmul ops (aten::mm/addmm/bmm, oneDNN's linear ops) and of the quantized linears'
  compiled kernels (`paged_hf::matmul`: calls outside torch);
- attention: everything inside the paged attention calls (`paged_hf::attention`: the cache write and the kernel);
- other ops: every other torch op's self time (copies, sampling's ops, ...) and the compiled elementwise ops
  (`paged_hf::elementwise`: RMSNorm, rotary, SiLU-and-multiply);
- Python: what is left inside the step's phases (`paged_hf::schedule`, `step_inputs`, `model`: HF's module code
  and dispatch, `sample_and_stop`), and of the step outside them (outputs, bookkeeping);
- idle: the profiled loop's time between steps.
A profiled step runs each lean decoder layer as its dozen calls, not as the one compiled call of an unprofiled
step (worker/fast_paths/native_layer.py: the same kernels, which the profiler could not tell apart inside it).
The intra-op worker threads' work is in the op that waits for it (the main thread's op time). The profiler's own
cost per recorded op lands outside the kernels, so the kernels' share is also given over the same kind of step
run without the profiler just before and after (the kernels' time barely changes under it: a few long ops).
"""

from __future__ import annotations

import random
import time

import torch

import paged_hf
from paged_hf import profiling
from paged_hf.bench.model_shapes import resolve_model_shape
from paged_hf.loader import default_model

PROMPT_LEN = 64
MIXED_PROMPT_LEN = 512
NUM_PROFILED_STEPS = 5
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_weight_int8pack_mm")
PHASES = ("schedule", "step_inputs", "model", "sample_and_stop")


def is_matmul(name: str) -> bool:
    return name in MATMUL_OPS or "mkldnn" in name or "onednn" in name


def split_step_time(events, wall_us: float, steps_us: float, other_ops: dict | None = None) -> dict[str, float]:
    """The categories (microseconds) of the main thread's time in `events` (a torch.profiler EventList);
    `other_ops` (if given) gets the "other ops" time by op name."""
    split = dict.fromkeys(("matmuls", "attention", "other ops", *(f"python: {p}" for p in PHASES),
                           "python: rest of the step"), 0.0)
    main = [e for e in events if e.name.startswith("paged_hf::")]
    thread = main[0].thread if main else None
    accounted = 0.0
    for event in events:
        if event.thread != thread:
            continue
        self_us = event.self_cpu_time_total
        name = event.name
        if name.startswith("paged_hf::"):
            phase = name.removeprefix("paged_hf::")
            key = ("attention" if phase == "attention" or _inside(event, "paged_hf::attention") else
                   "matmuls" if phase == "matmul" else "other ops" if phase == "elementwise" else f"python: {phase}")
        elif _inside(event, "paged_hf::attention"):
            key = "attention"
        elif is_matmul(name):
            key = "matmuls"
        else:
            key = "other ops"
        split[key] = split.get(key, 0.0) + self_us
        accounted += self_us
        if key == "other ops" and other_ops is not None:
            other_ops[name] = other_ops.get(name, 0.0) + self_us
    split["python: rest of the step"] += max(0.0, steps_us - accounted)
    split["idle"] = max(0.0, wall_us - steps_us)
    return split


def _inside(event, name: str) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == name:
            return True
        parent = parent.cpu_parent
    return False


def profile_steps(generator, num_steps: int, before_each=None) -> dict:
    """Profile `num_steps` generator.step() calls -> {"step_ms": median step wall, "split": {category: share},
    "plain_step_ms": the mean of as many steps of the same kind run before and after without the profiler,
    "kernels_ms": the mean profiled step's matmul and attention time}. The profiler costs ~1 us per op recorded
    (a few thousand ops a step), which lands outside the kernels: their time over the plain step is the share
    without that cost."""
    plain = _timed_steps(generator, num_steps, before_each)
    with profiling.enabled(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        walls = _timed_steps(generator, num_steps, before_each)
        wall = time.perf_counter() - start
    other_ops: dict[str, float] = {}
    split = split_step_time(prof.events(), wall * 1e6, sum(walls) * 1e6, other_ops)
    total = sum(split.values()) or 1.0
    top = sorted(other_ops.items(), key=lambda item: -item[1])[:5]
    plain += _timed_steps(generator, num_steps, before_each)  # before and after: the host's drift evens out
    step_ms = _median(walls) * 1e3
    shares = {k: v / total for k, v in split.items()}
    return {"step_ms": step_ms, "split": shares, "top_other_ops": {name: us / total for name, us in top},
            "plain_step_ms": sum(plain) * 1e3 / len(plain),
            "kernels_ms": (shares["matmuls"] + shares["attention"]) * sum(walls) * 1e3 / len(walls)}


def _timed_steps(generator, num_steps: int, before_each) -> list[float]:
    """The walls of `num_steps` steps (`before_each` called before each, outside its wall)."""
    walls = []
    for _ in range(num_steps):
        if before_each is not None:
            before_each()
        start = time.perf_counter()
        generator.step()
        walls.append(time.perf_counter() - start)
    return walls


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def run_profile(args) -> int:
    shape = resolve_model_shape(args)
    dtype = getattr(torch, args.dtype)
    model, tokenizer = default_model.load_model(args.model, dtype, args.device)
    num_seqs = args.profile_seqs
    config = {"max_num_seqs": num_seqs + 1, "max_num_batched_tokens": num_seqs + MIXED_PROMPT_LEN,
              **args.engine_config}
    generator = paged_hf.wrap(model, tokenizer, **config).generator
    rng = random.Random(args.seed)
    vocab = generator.info.vocab_size

    def prompt(length: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(length)]

    params = paged_hf.SamplingParams(max_new_tokens=generator.max_model_len - PROMPT_LEN, temperature=0.0,
                                     ignore_eos=True)
    mixed_len = min(MIXED_PROMPT_LEN, generator.max_model_len // 2)  # a small model's context may be short
    for _ in range(num_seqs):
        generator.add_request(prompt(PROMPT_LEN), params)
    while generator.stats()["num_running"] < num_seqs or generator.stats()["num_waiting"]:
        generator.step()
    for _ in range(3):
        generator.step()  # every sequence decoding; warm
    decode = profile_steps(generator, NUM_PROFILED_STEPS)
    short = paged_hf.SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    mixed = profile_steps(generator, NUM_PROFILED_STEPS,
                          lambda: generator.add_request(prompt(mixed_len), short))
    name = shape["name"] if shape else (args.model or "default model")
    print(format_profile(name, args.dtype, num_seqs, {"decode": decode, "mixed": mixed}), flush=True)
    return 0


def format_profile(model: str, dtype: str, num_seqs: int, steps: dict) -> str:
    from paged_hf.utils import describe_host  # noqa: PLC0415

    lines = [f"step profile: {model}, {dtype}, {num_seqs} sequences; host: {describe_host()}; "
             f"{torch.get_num_threads()} threads",
             "| share of the step | " + " | ".join(f"{kind} ({r['step_ms']:.1f} ms)" for kind, r in steps.items()) + " |",
             "|---|" + "---|" * len(steps)]
    categories = next(iter(steps.values()))["split"]
    for category in categories:
        lines.append(f"| {category} | " + " | ".join(f"{r['split'][category] * 100:.1f}%" for r in steps.values()) + " |")
    kernels = {kind: r["split"]["matmuls"] + r["split"]["attention"] for kind, r in steps.items()}
    lines.append("inside the matmul and attention kernels: " +
                 ", ".join(f"{kind} {share * 100:.1f}%" for kind, share in kernels.items()) + " of the profiled step; " +
                 ", ".join(f"{kind} {min(1.0, r['kernels_ms'] / r['plain_step_ms']) * 100:.1f}% of the step without "
                           f"the profiler ({r['plain_step_ms']:.1f} ms)" for kind, r in steps.items()))
    for kind, r in steps.items():
        lines.append(f"{kind}: largest other ops: " +
                     ", ".join(f"{name} {share * 100:.1f}%" for name, share in r["top_other_ops"].items()))
    return "\n".join(lines)
