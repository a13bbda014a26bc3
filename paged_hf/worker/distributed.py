"""Tensor parallelism (transformers' `tp_plan="auto"` under torchrun): every rank runs the same schedule.

Each rank runs its own generator on the same requests; scheduling is deterministic, and the logits are
identical on every rank (transformers gathers them), but sampling draws random numbers. So rank 0's sampled
tokens are broadcast each step and every rank appends exactly those: the ranks can never diverge.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def is_multi_rank() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def min_over_ranks(value: int) -> int:
    """The smallest `value` of all ranks: sizes every rank must agree on (ranks see different free memory)."""
    if not is_multi_rank():
        return value
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    tensor = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())


def broadcast_tokens(token_ids: list[int], device: torch.device) -> list[int]:
    """Rank 0's sampled tokens, on every rank (gloo on CPU, NCCL on GPUs)."""
    if not is_multi_rank() or not token_ids:
        return token_ids
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    tokens = torch.tensor(token_ids, dtype=torch.long, device=device)
    dist.broadcast(tokens, src=0)
    return tokens.tolist()
