"""`paged_hf.LLM(..., pipeline_parallel_size=N)`: the pipeline's other stages as local processes.

The user's process is stage 0; stages 1 .. N-1 are spawned here, each loading only its layers
(loader/pipeline_stage.py) into the same engine. The stages form a gloo process group on a free local port.
Every call that runs the engine (`generate`) is sent to the other stages first and run on all of them: they
schedule the same requests the same way and step together (engine/pipeline_step.py). For a server, or stages on
several hosts, `paged-hf serve --pipeline-parallel-size N` (torchrun) is the way (docs/scaling.md).
"""

from __future__ import annotations

import socket
import sys
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp

from paged_hf.hf.paged_model import wrap

#: a stage waits this long for a collective (a command, a neighbour's activations) before it gives up
STAGE_TIMEOUT = timedelta(minutes=30)


class PipelineStages:
    """Spawns the other stages and mirrors engine calls onto them. Stage 0's model comes from `load_model`."""

    def __init__(self, count: int, load_model, make_generator):
        """`load_model(stage, count)` -> (model, tokenizer); `make_generator(model, tokenizer)` -> generator: both
        picklable (they run in the spawned stages too)."""
        if dist.is_available() and dist.is_initialized():
            raise ValueError("pipeline_parallel_size > 1 starts its own process group; this process already has "
                             "one (torchrun): run `paged-hf serve --pipeline-parallel-size` instead")
        port = _free_port()
        context = mp.get_context("spawn")
        self.processes = [context.Process(target=_run_stage, args=(stage, count, port, load_model, make_generator),
                                          name=f"paged_hf-stage-{stage}", daemon=True)
                          for stage in range(1, count)]
        for process in self.processes:
            process.start()
        try:
            _join_group(0, count, port)
            self.model, self.tokenizer = load_model(0, count)
            self.generator = make_generator(self.model, self.tokenizer)
            self.group = dist.new_group(backend="gloo", timeout=STAGE_TIMEOUT)  # the commands
        except BaseException:  # (the other stages fail alike, or wait on this one)
            self._stop_processes(wait_s=2.0)
            raise
        self._closed = False

    def call(self, name: str, *args, **kwargs):
        """`generator.name(*args, **kwargs)` on every stage; -> stage 0's result."""
        self._check_alive()
        dist.broadcast_object_list([(name, args, kwargs)], src=0, group=self.group)
        return getattr(self.generator, name)(*args, **kwargs)

    def _check_alive(self) -> None:
        if self._closed:
            raise RuntimeError("the pipeline's stages were shut down")
        dead = [p for p in self.processes if not p.is_alive()]
        if dead:
            raise RuntimeError(f"pipeline stage process {dead[0].name} exited (exit code {dead[0].exitcode})")

    def close(self) -> None:
        """Stop the other stages and leave the process group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if all(p.is_alive() for p in self.processes):
            dist.broadcast_object_list([("stop", (), {})], src=0, group=self.group)
        self._stop_processes()

    def _stop_processes(self, wait_s: float = 10.0) -> None:
        for process in self.processes:
            process.join(wait_s)
            if process.is_alive():
                process.kill()
                process.join()
        if dist.is_initialized():
            dist.destroy_process_group()


def _run_stage(stage: int, count: int, port: int, load_model, make_generator) -> None:
    """A spawned stage: load its layers, then run what stage 0 sends until it says stop."""
    _join_group(stage, count, port)
    model, tokenizer = load_model(stage, count)
    generator = make_generator(model, tokenizer)
    group = dist.new_group(backend="gloo", timeout=STAGE_TIMEOUT)
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        name, args, kwargs = box[0]
        if name == "stop":
            break
        if "use_tqdm" in kwargs:
            kwargs["use_tqdm"] = False  # stage 0 shows the progress
        try:
            getattr(generator, name)(*args, **kwargs)
        except Exception:  # noqa: BLE001 - stage 0 raised the same (bad input is refused before any step)
            pass
    generator.engine_step.links.flush()
    dist.destroy_process_group()
    sys.exit(0)


def load_stage_model(name, dtype, device, stage: int, count: int):
    """(model, tokenizer) of stage `stage` of `count` of the checkpoint `name` (a `load_model` argument)."""
    from paged_hf.loader.default_model import load_model  # noqa: PLC0415

    return load_model(name, dtype, device, pipeline_stage=(stage, count))


def stage_generator(config: dict, model, tokenizer):
    """A stage's engine: `wrap`'s, with `config` (PagedConfig fields)."""
    return wrap(model, tokenizer, **config).generator


def _join_group(stage: int, count: int, port: int) -> None:
    dist.init_process_group("gloo", rank=stage, world_size=count, init_method=f"tcp://127.0.0.1:{port}",
                            timeout=STAGE_TIMEOUT)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
