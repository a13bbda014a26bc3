"""GPTQ at load (`quantization="w4a16_gptq"`): 4-bit weights chosen against the model's own activations, on
calibration text the model writes itself.

Round to nearest quantizes every weight alone. GPTQ (Frantar et al., 2022) quantizes a linear's input columns one
at a time and moves each column's rounding error onto the columns not yet quantized, through the inverse of the
inputs' second moment H = X^T X (the Hessian of the outputs' squared error), so the outputs on inputs like the
calibration ones change least. Columns go in decreasing order of H's diagonal (act-order: the inputs that carry
the most energy first, while the most columns remain to absorb their errors); each group's scale and zero point
are fixed beforehand from the unquantized weights by the min/max rule (static groups), so the result is the
layout round to nearest gives, contiguous groups that `Int4Linear` serves unchanged.

No corpus ships with the package and a serving machine may have no network, so the calibration text is sampled
from the model itself (temperature 1 from random first tokens, seeded: the same model gives the same weights), as
in LLM-QAT's data-free recipe. Linears that read one input (q/k/v, gate/up) share one H.

On the default model (eval-ppl): perplexity +27.6% of float32's by round to nearest, +13.8% by this (+12.8% of
bfloat16's in bfloat16; docs/quantization.md). The cost is at load: the calibration text's generation and one forward over it, and a
Python loop over every linear's input columns (about a minute for the default model on two cores).
"""

from __future__ import annotations

import torch

from paged_hf.kernels.quant_linear import quantize_int4_groups
from paged_hf.loader.smoothing import input_maxima

#: calibration text: this many sequences of this many tokens, sampled by the model
CALIBRATION_SEQUENCES = 16
CALIBRATION_LEN = 256
#: sequences per calibration forward
CALIBRATION_BATCH = 8
#: H's diagonal is raised by this fraction of its mean before it is inverted (GPTQ's damping)
DAMPING = 0.01
#: columns whose errors are moved in one matrix product (GPTQ's lazy batch updates)
BLOCK = 128
#: the float32 Hessians held at once; more linears than fit take more calibration passes
HESSIAN_BYTES = 1 << 30


@torch.inference_mode()
def self_generated_ids(model: torch.nn.Module, num_sequences: int = CALIBRATION_SEQUENCES,
                       length: int = CALIBRATION_LEN, seed: int = 0) -> torch.Tensor:
    """[num_sequences, length] token ids the model samples (temperature 1, nothing cut off) from random first
    tokens. Seeded without touching the global random state."""
    length = min(length, getattr(model.config, "max_position_embeddings", None) or length)
    vocab_size = model.get_input_embeddings().weight.shape[0]
    device = model.get_input_embeddings().weight.device
    with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device]):
        torch.manual_seed(seed)
        first = torch.randint(0, vocab_size, (num_sequences, 1), device=device)
        if length == 1:
            return first
        return model.generate(first, attention_mask=torch.ones_like(first), do_sample=True, temperature=1.0,
                              top_k=0, top_p=1.0, max_new_tokens=length - 1, min_new_tokens=length - 1,
                              pad_token_id=0, eos_token_id=None)


@torch.inference_mode()
def input_hessians(model: torch.nn.Module, linears: dict[str, torch.nn.Linear],
                   ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """name -> the float32 sum of x^T x [in, in] over every token of `ids` that reaches that linear's input."""
    hessians: dict[str, torch.Tensor] = {}

    def record(name):
        def hook(module, args, output):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            hessians[name] = hessians[name].addmm_(x.T, x) if name in hessians else x.T @ x
        return hook

    handles = [module.register_forward_hook(record(name)) for name, module in linears.items()]
    try:
        for batch in ids.split(CALIBRATION_BATCH):
            model(input_ids=batch, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return hessians


def gptq_int4(weight: torch.Tensor, hessian: torch.Tensor,
              group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ of weight [out, in] with input Hessian [in, in], act-order over static groups of `group_size`:
    (values [out, in] uint8 in [0, 15], scales and zeros [out, groups] float32), w ~ (u - z) * s, the scales and
    zeros those of `quantize_int4_groups` (round to nearest, which this equals where H is diagonal)."""
    w = weight.detach().float().clone()
    n, k = w.shape
    _, scales, zeros = quantize_int4_groups(w, group_size)
    h = hessian.detach().float().to(w.device).clone()
    dead = torch.diag(h) == 0  # an input that is always 0: its weights cannot matter
    h[dead, dead] = 1
    w[:, dead] = 0
    h.diagonal().add_(DAMPING * torch.mean(torch.diag(h)))
    order = torch.argsort(torch.diag(h), descending=True, stable=True)
    w, h = w[:, order], h[order][:, order]
    # the upper Cholesky factor of H^-1: row i holds how column i's error spreads over the columns after it
    inverse = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    group_of = order // group_size
    column_scales, column_zeros = scales[:, group_of], zeros[:, group_of]  # [out, in], in the permuted order
    values = torch.empty(n, k, device=w.device)
    for begin in range(0, k, BLOCK):
        end = min(begin + BLOCK, k)
        block = w[:, begin:end].clone()
        errors = torch.empty_like(block)
        for i in range(end - begin):
            c = begin + i
            column, s, z = block[:, i], column_scales[:, c], column_zeros[:, c]
            u = torch.clamp(torch.round(column / s) + z, 0, 15)
            values[:, c] = u
            errors[:, i] = (column - (u - z) * s) / inverse[c, c]
            block[:, i:] -= errors[:, i:i + 1] * inverse[c, c:end][None, :]
        w[:, end:] -= errors @ inverse[begin:end, end:]
    unpermuted = torch.empty_like(values)
    unpermuted[:, order] = values
    return unpermuted.to(torch.uint8), scales, zeros


def gptq_quantize(model: torch.nn.Module, linears: dict[str, torch.nn.Linear], group_size: int) -> dict:
    """name -> GPTQ's (values, scales, zeros) for every linear of `linears`, from one calibration text the model
    writes; the Hessians taken in as many passes over it as `HESSIAN_BYTES` requires."""
    ids = self_generated_ids(model)
    _, groups = input_maxima(model, linears)  # which linears read one input (they share one Hessian)
    grouped = {name for group in groups for name in group}
    groups += [[name] for name in linears if name not in grouped]  # not reached by that forward (an expert)
    passes: list[list[list[str]]] = [[]]
    held = 0
    for group in groups:
        size = 4 * linears[group[0]].in_features ** 2
        if passes[-1] and held + size > HESSIAN_BYTES:
            passes.append([])
            held = 0
        passes[-1].append(group)
        held += size
    results = {}
    for groups_of_pass in passes:
        hessians = input_hessians(model, {group[0]: linears[group[0]] for group in groups_of_pass}, ids)
        for group in groups_of_pass:
            hessian = hessians.pop(group[0], None)  # None: no calibration token reached it
            for name in group:
                weight = linears[name].weight
                results[name] = (quantize_int4_groups(weight, group_size) if hessian is None
                                 else gptq_int4(weight, hessian, group_size))
    return results
