"""Faster stand-ins for transformers' torch reference recurrences, used by a hybrid model's own layer code during a
step (worker/hybrid/recurrent_mixers.py swaps them into the layer's module for the step and back after it).

transformers falls back to `torch_recurrent_gated_delta_rule` when flash-linear-attention is absent (every CPU):
for one decode token it makes seven full passes over the [batch, heads, key, value] state (decay, the key's
product and its sum, the update's outer product and sum, the query's product and its sum). The stand-in makes
three: decay, one batched matmul for the key's and the query's reads, and the update in place (`baddbmm_`), using
q.S' = q.S + (q.k) delta for the output. Same arithmetic in float32 as the reference, summed in another order.
Anything but a CPU decode (one token a sequence, no packed sequences) goes to the reference unchanged, so the
swap never changes what a call means; wrap()'s engine probe checks the result against the model's own forward.
"""

from __future__ import annotations

import torch

from paged_hf.worker.code_match import forward_globals, reads_name

#: the reference's name in a modeling module (Qwen3.5, Qwen3-Next, OLMo-hybrid, ... each has its own copy)
GATED_DELTA_RULE = "torch_recurrent_gated_delta_rule"


def gated_delta_rule_decode(reference, l2norm):
    """A drop-in for `reference` (a transformers torch_recurrent_gated_delta_rule) with the module's `l2norm`."""

    def rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
             use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
        if query.device.type != "cpu" or query.shape[1] != 1 or cu_seqlens is not None or initial_state is None:
            return reference(query, key, value, g=g, beta=beta, initial_state=initial_state,
                             output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                             cu_seqlens=cu_seqlens, **kwargs)
        out_dtype = query.dtype
        batch, _, num_k_heads, k_dim = key.shape
        num_v_heads, v_dim = value.shape[-2:]
        if num_k_heads != num_v_heads:  # each query/key head serves consecutive value heads
            query = query.repeat_interleave(num_v_heads // num_k_heads, dim=2)
            key = key.repeat_interleave(num_v_heads // num_k_heads, dim=2)
        q, k, v, beta, g = (x[:, 0].to(torch.float32) for x in (query, key, value, beta, g))  # [B, H, (D)]
        if use_qk_l2norm_in_kernel:
            q, k = l2norm(q, dim=-1, eps=1e-6), l2norm(k, dim=-1, eps=1e-6)
        q = q / (k_dim ** 0.5)
        state = initial_state.to(torch.float32) * g.exp()[..., None, None]  # a new tensor: the input stays
        rows = batch * num_v_heads
        flat = state.view(rows, k_dim, v_dim)
        reads = torch.bmm(torch.stack([k, q], dim=-2).reshape(rows, 2, k_dim), flat)  # k.S and q.S: one pass
        k_read, q_read = reads[:, 0], reads[:, 1]
        delta = (v.reshape(rows, v_dim) - k_read) * beta.reshape(rows, 1)
        flat.baddbmm_(k.reshape(rows, k_dim, 1), delta[:, None])  # S += k delta^T, in place
        out = q_read + (q * k).sum(-1).reshape(rows, 1) * delta
        out = out.view(batch, 1, num_v_heads, v_dim).to(out_dtype)
        return out, (state if output_final_state else None)

    rule.__name__ = GATED_DELTA_RULE
    return rule


class RecurrenceKernels:
    """The stand-ins for the references that the mixers' modeling modules call, swapped into those modules'
    globals for a step (`with`), and back after it. A module whose global is no longer the reference seen at
    wrap() (the user replaced it) keeps what it has."""

    def __init__(self, mixers: list[torch.nn.Module]):
        self.swaps = []  # (module globals, name, reference, stand-in)
        seen = set()
        for mixer in mixers:
            space = forward_globals(mixer)
            if id(space) in seen or not reads_name(mixer, GATED_DELTA_RULE):
                continue
            seen.add(id(space))
            reference, l2norm = space.get(GATED_DELTA_RULE), space.get("l2norm")
            if callable(reference) and callable(l2norm):
                self.swaps.append((space, GATED_DELTA_RULE, reference, gated_delta_rule_decode(reference, l2norm)))
        self._swapped = []

    def __enter__(self) -> None:
        self._swapped = []
        for space, name, reference, stand_in in self.swaps:
            if space.get(name) is reference:
                space[name] = stand_in
                self._swapped.append((space, name, reference))

    def __exit__(self, *exc) -> None:
        for space, name, reference in self._swapped:
            space[name] = reference
        self._swapped = []
