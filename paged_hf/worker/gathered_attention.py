"""Attention over a layer's cached blocks transformed token by token: what a module attends when it is not what
it cached (worker/step_books.py says which transform).

MLA modules cache a latent and attend its expansion by their own `expand_kv`; DiffLlama and JetMoE attend
their cached heads rearranged. Once per layer and step, the blocks the step's requests read are gathered, the
transform turns them into blocks of what the module attends, and the torch kernel attends them over block
tables renumbered to the gathered blocks: the model's own math, redone every step for the whole context (as
HF's own cache does for MLA). Absorbing `kv_b_proj` into the query for MLA decode is the fast path left for later.
"""

from __future__ import annotations

import torch

from paged_hf.kernels.torch_kernel import TorchKernel
from paged_hf.utils import cdiv
from paged_hf.worker.step_books import Transform
from paged_hf.worker.step_inputs import AttentionMetadata


class GatheredAttention:
    def __init__(self):
        self.kernel = TorchKernel()
        self._plans: dict[torch.device, tuple[torch.Tensor, object]] = {}

    def begin_step(self) -> None:
        self._plans = {}

    def attend(self, transform: Transform, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               key_cache: torch.Tensor, value_cache: torch.Tensor, metadata: AttentionMetadata,
               **masking) -> torch.Tensor:
        """query/key/value: what the module hands its attention function, [num_tokens, heads, dim] (key and
        value: this step's tokens, transformed); caches: the layer's [num_blocks, block_size, heads, dim].
        -> [num_tokens, num_heads, value head_dim]."""
        device = key_cache.device
        if device not in self._plans:
            self._plans[device] = self._plan(metadata, device)
        blocks, plan = self._plans[device]
        key_blocks, value_blocks = transform(key_cache.index_select(0, blocks), value_cache.index_select(0, blocks))
        return self.kernel.attend(query, key, value, key_blocks, value_blocks, plan, **masking)

    def _plan(self, metadata: AttentionMetadata, device: torch.device) -> tuple[torch.Tensor, object]:
        """The blocks the step reads, and the torch kernel's plan over tables renumbered to them."""
        tables = [table[: cdiv(length, metadata.block_size)]
                  for table, length in zip(metadata.block_tables, metadata.context_lens)]
        blocks = sorted({block for table in tables for block in table})
        position = {block: i for i, block in enumerate(blocks)}
        renumbered = AttentionMetadata(metadata.block_size, metadata.query_start_loc, metadata.context_lens,
                                       [[position[block] for block in table] for table in tables],
                                       metadata.slot_mapping, bidirectional=metadata.bidirectional)
        return torch.tensor(blocks, dtype=torch.long, device=device), self.kernel.plan(renumbered, device)
