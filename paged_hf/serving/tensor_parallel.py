"""`paged-hf serve` with tensor or pipeline parallelism: rank 0 serves HTTP, the other ranks mirror its engine.

Under torchrun (`torchrun --nproc-per-node N -m paged_hf serve ...`) every rank loads its shard
(`tp_plan="auto"`), or with `--pipeline-parallel-size N` its stage's layers (loader/pipeline_stage.py; with
`--tensor-parallel-size T` too, N stages of T ranks, each rank its slice of its stage: loader/stage_shards.py), and
builds the same engine; rank 0 wraps it in a `LockstepGenerator` and serves the app, the others `follow()` (see
lockstep.py). `--tensor-parallel-size N` outside torchrun re-executes the same command under torchrun with N local
ranks (as `--pipeline-parallel-size N` does). A rank that fails ends the whole server with an error and exit
status 1 (torchrun also stops the remaining ranks when one exits).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from paged_hf.serving.assembly import build_app, load_engine, make_server
from paged_hf.serving.lockstep import LockstepGenerator, RankFailure, control_group, follow

#: timeout of the model's own collectives (loading a large model's shards may take long on a slow rank)
COLLECTIVE_TIMEOUT = timedelta(minutes=30)
#: seconds rank 0 waits for its server to wind down after a rank failed, before it exits anyway
FAILURE_EXIT_S = 10.0


def serve_tensor_parallel(args: argparse.Namespace) -> int:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    pipeline = args.pipeline_parallel_size > 1
    size = args.pipeline_parallel_size * args.tensor_parallel_size
    if world_size == 1:
        _relaunch_under_torchrun(args, size)  # does not return
    if size not in (1, world_size):
        raise ValueError(f"--pipeline-parallel-size {args.pipeline_parallel_size} x --tensor-parallel-size "
                         f"{args.tensor_parallel_size} = {size} ranks does not match torchrun's {world_size}")
    _init_process_group(args.device)
    group = control_group()
    from paged_hf.serving.openai.engine_loop import reserve_torch_threads  # noqa: PLC0415 - optional: fastapi

    rank = dist.get_rank()
    # rank 0 steps on its engine thread (as `paged-hf serve`), the other ranks on their main thread
    engine_threads = reserve_torch_threads() if rank == 0 else None
    model, tokenizer, generator = load_engine(args, **_shard_of(args, rank, world_size))
    if rank != 0:
        try:
            follow(generator, group)
        except RankFailure as exc:
            print(f"paged-hf serve (rank {rank}): error: {exc}; exiting", file=sys.stderr, flush=True)
            os._exit(1)  # no clean teardown: the group is broken
        dist.destroy_process_group()
        return 0
    lockstep = LockstepGenerator(generator, group)
    server = make_server(args, build_app(args, model, tokenizer, lockstep, engine_threads))
    lockstep.on_failure = lambda exc: _end_server(server, exc)  # the server is built around lockstep
    kind = (f"pipeline parallel ({args.pipeline_parallel_size} stages of {world_size // args.pipeline_parallel_size} "
            "ranks)" if pipeline else "tensor parallel")
    print(f"paged-hf serve: {kind} over {world_size} ranks ({dist.get_backend()})", file=sys.stderr)
    server.run()
    lockstep.close()
    if lockstep.failure is not None:
        os._exit(1)
    dist.destroy_process_group()
    return 0


def _shard_of(args: argparse.Namespace, rank: int, world_size: int) -> dict:
    """`load_model`'s arguments for this rank: its pipeline stage (a run of the layers; with tensor parallelism
    too, stages are the outer split: ranks 0..T-1 hold stage 0), else transformers' tensor-parallel shard. Under a
    plain torchrun (no size flag) every rank is a tensor-parallel rank."""
    if args.pipeline_parallel_size == 1:
        return {"tp_plan": "auto"}
    ranks_per_stage = world_size // args.pipeline_parallel_size
    shard = {"pipeline_stage": (rank // ranks_per_stage, args.pipeline_parallel_size)}
    return {**shard, "tp_plan": "auto"} if ranks_per_stage > 1 else shard


def _relaunch_under_torchrun(args: argparse.Namespace, size: int) -> None:
    """Replace this process by torchrun running the same command on `size` local ranks."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={size}", "-m", "paged_hf", *args.argv]
    print(f"paged-hf serve: launching {size} ranks under torchrun", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os.execv(sys.executable, argv)


def _init_process_group(device: str) -> None:
    """gloo on CPU, NCCL on GPUs (each rank on its LOCAL_RANK's GPU); transformers then uses this group."""
    if dist.is_initialized():
        return
    if str(device).startswith("cuda"):
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank), timeout=COLLECTIVE_TIMEOUT)
    else:
        dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)


def _end_server(server, exc: BaseException) -> None:
    """A rank failed: say so, stop taking requests and exit (at the latest after FAILURE_EXIT_S)."""
    print(f"paged-hf serve: error: a rank failed ({type(exc).__name__}: {exc}); shutting down",
          file=sys.stderr, flush=True)
    server.should_exit = True
    timer = threading.Timer(FAILURE_EXIT_S, os._exit, args=(1,))
    timer.daemon = True
    timer.start()
