"""`paged-hf serve` beyond one process: which way a command goes (see docs/scaling.md; the flags are the command
line's, paged_hf.entrypoints.cli.add_scaling_args).

    paged-hf serve --tensor-parallel-size 2 ...     # relaunches itself under torchrun (one node)
    paged-hf serve --pipeline-parallel-size 2 ...   # the same, the layers split into 2 stages
    paged-hf serve -pp 2 -tp 2 ...                  # 2 stages of 2 tensor-parallel ranks each: 4 ranks
    torchrun --nproc-per-node 2 -m paged_hf serve ...  # the same; torchrun's flags for several nodes
    paged-hf serve --replicas 2 ...                 # replicas on Ray Serve, routed by prefix and adapter
"""

from __future__ import annotations

import argparse
import os

from paged_hf.serving.ray.launch import serve_replicas
from paged_hf.serving.tensor_parallel import serve_tensor_parallel


def under_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def serve_scaled(args: argparse.Namespace) -> int | None:
    """Serve with tensor parallelism or replicas when the flags (or torchrun) ask for it; None otherwise."""
    for flag in ("tensor_parallel_size", "pipeline_parallel_size"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.replicas < 0:
        raise ValueError(f"--replicas must be >= 0, got {args.replicas}")
    if args.tensor_parallel_size > 1 or args.pipeline_parallel_size > 1 or under_torchrun():
        if args.replicas:
            raise ValueError("--replicas with tensor or pipeline parallelism is not supported: give one or the other")
        return serve_tensor_parallel(args)
    if args.replicas:
        return serve_replicas(args)
    return None
