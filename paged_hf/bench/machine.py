"""The machine's limit for a workload: how fast could any engine possibly run it here?

Why: a tok/s number alone does not say whether an engine is good or the machine is slow. So we measure what
this machine does at the model's own shapes, in the dtype the bench runs (matmul FLOP/s with 256-row inputs, which
is what a batched step looks like, and memory bandwidth as a streaming read of a large tensor) and turn the
workload into a minimum time:

- compute: every prompt and generated token goes through every linear layer (2 x in x out FLOPs per token),
  plus attention (QK^T and PV: 4 x heads x head_dim x context FLOPs per token and layer), plus the lm_head for
  every sampled token; all at the measured matmul rate (the lm_head at its own rate);
- bandwidth: generation is sequential, so at least ``max(max_new_tokens)`` steps, each reading every weight
  once;
- minimum time = the larger of the two. An engine's fraction of the limit = minimum time / its wall time.

The compute floor counts every prompt token, as if nothing were cached; ``min_time_prefix_once_s`` counts each
shared prompt prefix once, which is the floor an engine with prefix caching can approach.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from paged_hf.bench.workloads import Workload
from paged_hf.loader.default_model import ensure_default_checkpoint, is_default_model
from paged_hf.worker.fast_paths.packed_linears import PackedLinear, packable_dtypes
from paged_hf.worker.huge_pages import into_huge_pages


@dataclass
class ModelShape:
    num_layers: int
    hidden_size: int
    num_heads: int
    head_dim: int
    linear_shapes: list[tuple[int, int]]  # (in, out) of every linear layer except the lm_head
    lm_head_shape: tuple[int, int]
    num_params: int
    weight_bytes: int

    @property
    def intermediate_size(self) -> int:
        return max(out for _, out in self.linear_shapes)


def model_shape(model_name: str | None, dtype_bytes: int = 4) -> ModelShape:
    """The model's layer shapes, read off a meta-device instance (no weights loaded, no memory used)."""
    source = ensure_default_checkpoint() if is_default_model(model_name) else model_name
    config = AutoConfig.from_pretrained(source)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    lm_head = model.get_output_embeddings()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not lm_head]
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    num_heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
    num_params = sum(p.numel() for p in model.parameters())  # tied weights are one parameter, counted once
    return ModelShape(
        num_layers=text.num_hidden_layers, hidden_size=text.hidden_size, num_heads=num_heads, head_dim=head_dim,
        linear_shapes=[(m.in_features, m.out_features) for m in linears],
        lm_head_shape=(lm_head.weight.shape[1], lm_head.weight.shape[0]),
        num_params=num_params, weight_bytes=num_params * dtype_bytes,
    )


def _synchronize(device) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)


def _time_op(op, device, min_seconds: float) -> tuple[float, int]:
    """(seconds, iterations) of repeating ``op`` for at least ``min_seconds`` after one warm-up call."""
    op()
    _synchronize(device)
    iterations, start = 0, time.perf_counter()
    while True:
        op()
        iterations += 1
        _synchronize(device)
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return elapsed, iterations


def matmul_flops(m: int, k: int, n: int, device="cpu", min_seconds: float = 0.5, dtype: str = "float32") -> float:
    """Measured FLOP/s of a [m, k] x [k, n] matmul in `dtype` (bf16 runs 2-3x fp32 on CPUs with AVX-512 BF16):
    the faster of `torch.mm` and, on CPU, oneDNN's matmul on a packed weight (what paged_hf's linears run;
    on AMD CPUs MKL's float32 GEMM runs AVX2 kernels at under half of it)."""
    a = torch.randn(m, k, device=device, dtype=getattr(torch, dtype))
    b = torch.randn(k, n, device=device, dtype=a.dtype)
    out = torch.empty(m, n, device=device, dtype=a.dtype)
    ops = [lambda: torch.mm(a, b, out=out)]
    if a.device.type == "cpu" and a.dtype in packable_dtypes():
        linear = torch.nn.Linear(k, n, bias=False, device=device, dtype=a.dtype)
        with torch.no_grad():
            linear.weight.copy_(b.t())
        packed = PackedLinear(linear)  # the engine's own packed layer
        ops.append(lambda: packed(a))
    rates = []
    for op in ops:
        elapsed, iterations = _time_op(op, device, min_seconds)
        rates.append(2.0 * m * k * n * iterations / elapsed)
    return max(rates)


def copy_bandwidth(num_bytes: int = 256 << 20, device="cpu", min_seconds: float = 0.5) -> float:
    """Measured bytes/s of a large tensor copy, counting the bytes read and the bytes written."""
    src = torch.ones(num_bytes // 4, device=device)
    dst = torch.empty_like(src)
    elapsed, iterations = _time_op(lambda: dst.copy_(src), device, min_seconds)
    return 2.0 * num_bytes * iterations / elapsed


def read_bandwidth(num_bytes: int = 256 << 20, device="cpu", min_seconds: float = 0.5) -> float:
    """Measured bytes/s of a streaming read (a large tensor's sum: one pass over memory, nothing written back):
    the rate a decode step's weight reads can approach, which a copy (half of its bytes written) does not show.
    On the CPU from 2 MB pages where Linux offers them, as the engine's weights are (worker/huge_pages.py)."""
    src = torch.ones(num_bytes // 4, device=device)
    if src.device.type == "cpu":
        into_huge_pages([src])
    elapsed, iterations = _time_op(lambda: src.sum(), device, min_seconds)
    return num_bytes * iterations / elapsed


def step_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step of one sequence reads: every parameter and buffer storage once (stacked
    or tied tensors share one), quantized ones at their stored size; the input embedding's table only where the
    lm_head shares it (a step reads one row of it per token)."""
    embedding = model.get_input_embeddings().weight.untyped_storage()
    output = getattr(model.get_output_embeddings(), "weight", None)  # none on a quantized head (w4a8's Int8Linear)
    skip = None if output is not None and output.untyped_storage().data_ptr() == embedding.data_ptr() else \
        embedding.data_ptr()
    return weight_bytes(model, skip)


def weight_bytes(model: torch.nn.Module, skip_storage: int | None = None) -> int:
    """Bytes of the model's parameter and buffer storages, each once (stacked or tied tensors share one), but the
    storage at `skip_storage`."""
    storages = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        storage = tensor.untyped_storage()
        if storage.data_ptr() != skip_storage:
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def measure(shape: ModelShape, device="cpu", rows: int = 256, min_seconds: float = 0.5, dtype: str = "float32") -> dict:
    """The machine's rates at the model's shapes, in `dtype`."""
    hidden, inter = shape.hidden_size, shape.intermediate_size
    return {
        "device": str(device),
        "dtype": dtype,
        "num_threads": torch.get_num_threads(),
        "matmul_rows": rows,
        "matmul_flops_mlp": matmul_flops(rows, hidden, inter, device, min_seconds, dtype),
        "matmul_flops_lm_head": matmul_flops(rows, *shape.lm_head_shape, device, min_seconds, dtype),
        "matmul_flops_one_row": matmul_flops(1, hidden, inter, device, min_seconds, dtype),
        "copy_bandwidth_bytes_per_s": copy_bandwidth(device=device, min_seconds=min_seconds),
        "read_bandwidth_bytes_per_s": read_bandwidth(device=device, min_seconds=min_seconds),
    }


def workload_flops(shape: ModelShape, workload: Workload, prefix_once: bool = False) -> dict:
    """FLOPs the workload needs, split by where they are spent. ``prefix_once``: a prompt's prefix shared
    with an earlier request is not computed again (its attention over that prefix is not either)."""
    linear_per_token = 2 * sum(i * o for i, o in shape.linear_shapes)
    attn_per_context = 4 * shape.num_layers * shape.num_heads * shape.head_dim
    num_tokens = num_context = num_sampled = 0
    seen: list[list[int]] = []
    for request in workload.requests:
        prompt = request.prompt_token_ids
        skip = max((_common_prefix(prompt, s) for s in seen), default=0) if prefix_once else 0
        skip = min(skip, len(prompt) - 1)  # the last prompt token is always computed: its logits are needed
        seen.append(prompt)
        total = len(prompt) + request.max_new_tokens - 1  # the last generated token is never fed back
        num_tokens += total - skip
        num_context += total * (total + 1) // 2 - skip * (skip + 1) // 2  # token at position p sees p + 1 keys
        num_sampled += request.max_new_tokens
    return {
        "linear": linear_per_token * num_tokens,
        "attention": attn_per_context * num_context,
        "lm_head": 2 * shape.lm_head_shape[0] * shape.lm_head_shape[1] * num_sampled,
        "num_tokens": num_tokens,
    }


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _compute_seconds(flops: dict, rates: dict) -> float:
    return ((flops["linear"] + flops["attention"]) / rates["matmul_flops_mlp"]
            + flops["lm_head"] / rates["matmul_flops_lm_head"])


def limit(shape: ModelShape, workload: Workload, rates: dict) -> dict:
    """The workload's minimum time on this machine and the useful tok/s that would give."""
    flops = workload_flops(shape, workload)
    compute_s = _compute_seconds(flops, rates)
    min_steps = max((r.max_new_tokens for r in workload.requests), default=0)
    bandwidth_s = min_steps * shape.weight_bytes / rates["read_bandwidth_bytes_per_s"]
    min_time = max(compute_s, bandwidth_s)
    prefix_once_s = max(_compute_seconds(workload_flops(shape, workload, prefix_once=True), rates), bandwidth_s)
    return {
        "model": asdict(shape) | {"intermediate_size": shape.intermediate_size},
        "rates": rates,
        "flops": flops,
        "total_flops": flops["linear"] + flops["attention"] + flops["lm_head"],
        "compute_s": compute_s,
        "min_steps": min_steps,
        "bandwidth_s": bandwidth_s,
        "min_time_s": min_time,
        "min_time_prefix_once_s": prefix_once_s,
        "max_useful_tokens_per_s": workload.num_new_tokens / min_time if min_time > 0 else math.inf,
    }


def peak_rss_bytes() -> int | None:
    """This process's peak resident set size (the kernel's high-water mark; psutil's current RSS as a fallback)."""
    try:
        import resource  # noqa: PLC0415 - Unix-only

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB
    except ImportError:  # pragma: no cover - Windows
        import psutil  # noqa: PLC0415 - optional (the bench extra), Windows' fallback only

        return psutil.Process().memory_info().rss


def current_rss_bytes() -> int:
    """This process's resident set size now (psutil: the bench extra)."""
    import psutil  # noqa: PLC0415 - optional (the bench extra)

    return psutil.Process().memory_info().rss
