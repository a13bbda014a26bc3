"""The model's final RMSNorm and its LM head on the kept rows, computed by the decoder stack's compiled call right
after its last layer (`kernels/csrc/lean_layer.cpp`'s `tail`), where the model's forward is Llama's
(llama_forward.py) and the stack runs as one call.

Why: at one row, norming the stack's output, keeping the sampled rows and calling the head were three Python
module calls, each paying for its objects and code fetched again after the weights' read evicted them; in the
stack's call they are two C calls (a batch-1 token's model call ~0.1 ms shorter on the default model). The same
kernels with the same arguments as the fused norm's and the head's own few-row call, so the same bits (RMSNorm is
row by row: norming only the kept rows gives those rows' bits; tests/worker/fast_paths/test_stack_tail.py).
Anything else (another norm or head module, a hook on either, a patched `slice_logits_to_keep`, indices that are
not a 1-D int64 tensor, more rows than the head's few-row loops take) leaves them to the forward's own calls.
"""

from __future__ import annotations

import torch

from paged_hf.worker.fast_paths.fused_layers import FusedRMSNorm
from paged_hf.worker.fast_paths.lean_layers import cpu_rows
from paged_hf.worker.fast_paths.native_layer import TailStruct, few_rows_of, linear_struct


class StackTail:
    """One step's request for the final norm and the head (`ask`), which the stack's call takes (`struct_for`) and
    answers with the logits (`take`); the head's struct kept while its few-row linear is the same object."""

    def __init__(self):
        self.enabled = True  # (tests turn it off to compare with the forward's own calls)
        self.served = 0  # a count, for tests
        self._logits: torch.Tensor | None = None  # [1, kept, vocab]: what the last stack call answered
        self._asked: tuple | None = None  # (norm's weight, eps, the head's few-row linear, keep) of this step
        self._head: tuple | None = None  # (few-row linear, its struct)
        self._held: tuple | None = None  # (kept rows, normed rows): what the struct points at, held for the call

    def ask(self, norm: torch.nn.Module, head: torch.nn.Module, keep) -> None:
        """Ask the next stack call of this step for `head(slice_logits_to_keep(norm(its output), keep))`, where
        `norm` is the fused RMSNorm stand-in and `head` a linear of the few-row loops (`few_rows_of`: the packed
        stand-in, or a quantized linear without hooks), and `keep` the rows' indices, a 1-D int64 tensor (the
        runner's); else ask nothing. (A hooked norm or head keeps its place: no stand-in of theirs is there.)"""
        self._logits = self._asked = None
        if not self.enabled or type(norm) is not FusedRMSNorm:
            return
        if not (isinstance(keep, torch.Tensor) and keep.dim() == 1 and cpu_rows(keep, torch.int64)):
            return
        small = few_rows_of(head)
        if small is not None:
            self._asked = norm.norm.weight, norm.norm.variance_epsilon, small, keep

    def struct_for(self, x: torch.Tensor) -> TailStruct | None:
        """The tail's struct for the stack's input x [1, tokens, hidden] (its output has x's shape), the logits
        tensor it writes made: or None (nothing asked, or kept rows the head's loops do not take)."""
        asked, self._asked = self._asked, None
        if asked is None:
            return None
        weight, eps, small, keep = asked
        count = keep.numel()
        if (count == 0 or count > x.shape[1] or not small.serves(x[0, :count]) or not cpu_rows(weight, x.dtype)
                or weight.shape != x.shape[2:]):
            return None
        made = self._head
        if made is None or made[0] is not small:
            made = self._head = small, linear_struct(small)
        normed = torch.empty(count, x.shape[2], dtype=x.dtype)
        self._logits = torch.empty(1, count, small.out_features, dtype=x.dtype)
        self._held = keep, normed
        return TailStruct(weight.data_ptr(), eps, made[1], keep.data_ptr(), count, normed.data_ptr(),
                          self._logits.data_ptr())

    def take(self) -> torch.Tensor | None:
        """The logits the last stack call computed, once; None where it computed none."""
        logits, self._logits, self._held, self._asked = self._logits, None, None, None
        self.served += logits is not None
        return logits
