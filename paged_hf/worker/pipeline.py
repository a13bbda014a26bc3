"""Pipeline parallelism: each process (a stage) runs one run of the decoder layers, as vLLM's pipeline ranks.

A stage model (loader/pipeline_stage.py) holds its layers and only those layers' KV blocks. One step's activations go forward as a
[num_tokens, hidden_size] tensor per stage boundary; the last stage samples and sends the step's result (its
tokens, logprobs and prompt logprobs) back to every other stage, whose schedulers then stay in step with it
(engine/pipeline_step.py). Both travel point to point, sent without waiting (`isend`): a stage hands its
micro-batch on and goes on with the next. With tensor parallelism inside the stages (loader/stage_shards.py) each
rank sends its hidden states to the same tensor rank of the next stage, and the result comes from one rank, the
last stage's first (its other ranks sample nothing), so no two ranks can append different tokens.
"""

from __future__ import annotations

import pickle
from collections import deque

import torch
import torch.distributed as dist

from paged_hf.loader.pipeline_stage import StageLayout, stage_of


def stage_links(model: torch.nn.Module) -> "StageLinks | None":
    """The links of a stage model (a collective: every stage makes them at the same point), None otherwise."""
    stage = stage_of(model)
    if stage is None:
        return None
    ranks = stage.count * stage.tp_size
    if not dist.is_initialized() or dist.get_world_size() != ranks or dist.get_rank() != stage.rank:
        raise ValueError(f"a pipeline stage ({stage.index} of {stage.count}, tensor rank {stage.tp_rank} of "
                         f"{stage.tp_size}) runs as rank {stage.rank} of a process group of {ranks} ranks "
                         "(torch.distributed, initialized before the engine)")
    return StageLinks(stage, dist.new_group(backend="gloo"))


class StageLinks:
    """Point-to-point messages of one stage: hidden states to the next stage and from the previous one, the
    step's result from the last stage to all others. Sends do not wait; they complete in order before the
    tensors they read are dropped. Messages pair up by order: every stage runs the same sequence of steps."""

    def __init__(self, stage: StageLayout, results_group):
        self.stage = stage
        self.results_group = results_group  # gloo: pickled results (the hidden states use the default group)
        self._sends: deque = deque()  # (work, tensors it reads) not yet known complete

    @property
    def samples(self) -> bool:
        """This rank samples and sends every step's result: the last stage's first tensor rank."""
        return self.stage.is_last and self.stage.tp_rank == 0

    def receive_hidden(self, num_tokens: int, hidden_size: int, dtype: torch.dtype,
                       device: torch.device) -> torch.Tensor:
        hidden = torch.empty(num_tokens, hidden_size, dtype=dtype, device=device)
        dist.recv(hidden, self.stage.rank - self.stage.tp_size)
        return hidden

    def send_hidden(self, hidden: torch.Tensor) -> None:
        hidden = hidden.contiguous()
        self._keep(dist.isend(hidden, self.stage.rank + self.stage.tp_size), hidden)

    def send_result(self, result) -> None:
        """The sampling rank: the step's result to every other rank."""
        data = torch.frombuffer(bytearray(pickle.dumps(result)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.long)
        for rank in range(self.stage.count * self.stage.tp_size):
            if rank != self.stage.rank:
                self._keep(dist.isend(size, rank, group=self.results_group), size)
                self._keep(dist.isend(data, rank, group=self.results_group), data)

    def receive_result(self):
        size = torch.empty(1, dtype=torch.long)
        sampler = (self.stage.count - 1) * self.stage.tp_size
        dist.recv(size, sampler, group=self.results_group)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(data, sampler, group=self.results_group)
        return pickle.loads(data.numpy().tobytes())

    def _keep(self, work, tensor: torch.Tensor) -> None:
        self._sends.append((work, tensor))
        while self._sends and self._sends[0][0].is_completed():
            self._sends.popleft()

    def flush(self) -> None:
        """Wait for every send (before the process group goes away)."""
        while self._sends:
            self._sends.popleft()[0].wait()
