"""`paged-hf serve` beyond one process: the flags, and which way a command goes (see docs/scaling.md).

    paged-hf serve --tensor-parallel-size 2 ...     # relaunches itself under torchrun (one node)
    torchrun --nproc-per-node 2 -m paged_hf serve ...  # the same; torchrun's flags for several nodes
    paged-hf serve --replicas 2 ...                 # replicas on Ray Serve, routed by prefix and adapter
"""

from __future__ import annotations

import argparse
import os


def add_scaling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("scaling out (docs/scaling.md)")
    group.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                       help="shard the model over N ranks (transformers' tp_plan='auto'); without torchrun it "
                       "launches N local ranks under torchrun itself (gloo on CPU, NCCL on GPUs)")
    group.add_argument("--replicas", type=int, default=0, metavar="N",
                       help="N engine replicas behind one endpoint on Ray Serve (needs the 'ray' extra)")
    group.add_argument("--routing", default="prefix", choices=("prefix", "round_robin"),
                       help="with --replicas: send a request where its prompt's first blocks (and its LoRA "
                       "adapter) already are (prefix, default), or to each replica in turn (round_robin)")
    group.add_argument("--ray-address", default=None, help="with --replicas: a running Ray cluster (default: "
                       "start a local one)")
    group.add_argument("--num-cpus-per-replica", type=float, default=1.0, help="with --replicas: Ray CPUs per replica")
    group.add_argument("--num-gpus-per-replica", type=float, default=0.0, help="with --replicas: Ray GPUs per replica")


def under_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def serve_scaled(args: argparse.Namespace) -> int | None:
    """Serve with tensor parallelism or replicas when the flags (or torchrun) ask for it; None otherwise."""
    if args.tensor_parallel_size < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {args.tensor_parallel_size}")
    if args.replicas < 0:
        raise ValueError(f"--replicas must be >= 0, got {args.replicas}")
    if args.tensor_parallel_size > 1 or under_torchrun():
        if args.replicas:
            raise ValueError("--replicas with tensor parallelism is not supported: give one or the other")
        from paged_hf.serving.tensor_parallel import serve_tensor_parallel  # noqa: PLC0415

        return serve_tensor_parallel(args)
    if args.replicas:
        from paged_hf.serving.ray.launch import serve_replicas  # noqa: PLC0415

        return serve_replicas(args)
    return None
