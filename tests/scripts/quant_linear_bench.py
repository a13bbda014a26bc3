"""Microbenchmark of the quantized linears (kernels/quant_linear.py) against torch's float32 (oneDNN-packed, as the
engine runs it) and bfloat16 linears, at the default model's and the Llama-3.2-1B shape's linear sizes, for 1, 16,
64 and 256 rows. Prints one line per (shape, rows) with milliseconds per call, best of 3 rounds.

    .venv/bin/python tests/scripts/quant_linear_bench.py [--threads 2] [--rows 1,16,64,256]
"""

from __future__ import annotations

import argparse
import time

import torch

from paged_hf.kernels import quant_gemm
from paged_hf.kernels.quant_linear import Int4Linear, Int8Linear, quantize_int4_groups, quantize_int8_per_channel
from paged_hf.utils import describe_host

SHAPES = {"default 576->1536": (576, 1536), "default 1536->576": (1536, 576), "1b 2048->8192": (2048, 8192),
          "1b 8192->2048": (8192, 2048), "1b 2048->2048": (2048, 2048)}


def best_ms(call, repeats: int) -> float:
    call()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeats):
            call()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rows", default="1,16,64,256")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"host: {describe_host()}; kernels: {quant_gemm.isa()}; threads {args.threads}")
    for label, (k, n) in SHAPES.items():
        torch.manual_seed(0)
        weight = torch.randn(n, k) / k ** 0.5
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
        w_bf16 = weight.bfloat16()
        q, scale = quantize_int8_per_channel(weight)
        values, scales, zeros = quantize_int4_groups(weight, 64)
        modules = {"w8a8": Int8Linear(q, scale, None, torch.float32, True),
                   "w8a16": Int8Linear(q, scale, None, torch.float32, False),
                   "w4a16_g64": Int4Linear(values, scales, zeros, 64, None, torch.float32)}
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k)
            x_bf16 = x.bfloat16()
            repeats = max(2, int(2e8 / (rows * k * n)))
            times = {"fp32": best_ms(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
                                     repeats),
                     "bf16": best_ms(lambda: torch.nn.functional.linear(x_bf16, w_bf16), repeats)}
            times.update({name: best_ms(lambda m=m: m(x), repeats) for name, m in modules.items()})
            print(f"{label:18s} rows {rows:4d}: " + "  ".join(f"{name} {ms:7.3f}" for name, ms in times.items())
                  + f"  (ms; w8a8 x{times['fp32'] / times['w8a8']:.2f} of fp32, x{times['bf16'] / times['w8a8']:.2f}"
                  f" of bf16; w4a16 x{times['fp32'] / times['w4a16_g64']:.2f} of fp32)", flush=True)


if __name__ == "__main__":
    main()
