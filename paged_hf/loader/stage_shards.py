"""Tensor parallelism inside a pipeline stage: each of a stage's ranks keeps a slice of its decoder layers' linears.

The split is Megatron's, as transformers' `base_model_tp_plan` names it: a `colwise` linear (q/k/v, gate/up) keeps
a contiguous slice of its output features (whole heads, whole MLP channels), a `rowwise` one (o, down) the matching
slice of its input features and sums its output over the stage's ranks (one all-reduce after the attention and one
after the MLP, as transformers' own tensor parallelism). The embeddings, norms and LM head stay whole on every rank,
so each rank holds the stage's hidden states in full, sends them to the same rank of the next stage and computes
the same logits. The model's own attention code reads the head count off its q/k/v shapes, and so does the engine
(worker/probes/model_probe.py): a rank's cache holds its own heads. transformers' own pipeline-with-tensor loading
(`DistributedConfig(pp_size=..., tp_size=...)`) is not used: in 5.24 it fails to load (its plan names the
parameters its pipeline dropped).
"""

from __future__ import annotations

import fnmatch

import torch
import torch.distributed as dist

#: plan styles that keep the module whole on every rank (at inference: nothing to do)
REPLICATED = ("replicated_with_grad_allreduce", "replicated")


class RowwiseShard(torch.nn.Linear):
    """A rowwise linear's slice: its input features' share of the product, summed over the stage's ranks. The bias
    is added once (rank 0's). A subclass of Linear, so the fused and packed paths leave it to this forward."""

    def __init__(self, linear: torch.nn.Linear, rank: int, size: int, group):
        in_features = linear.in_features // size
        super().__init__(in_features, linear.out_features, bias=linear.bias is not None and rank == 0,
                         device="meta", dtype=linear.weight.dtype)
        start = rank * in_features
        self.weight = torch.nn.Parameter(linear.weight.detach()[:, start:start + in_features].clone(),
                                         requires_grad=False)
        if self.bias is not None:
            self.bias = torch.nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.nn.functional.linear(x, self.weight, self.bias)
        dist.all_reduce(out, group=self.group)
        return out


def tensor_group(stage_index: int, stage_count: int, size: int):
    """The group of stage `stage_index`'s `size` ranks (global ranks index * size .. + size - 1: the pipeline is
    the outer dimension, as in transformers' device mesh), on the default backend (gloo on CPU, NCCL on GPUs: the
    all-reduces run on the hidden states' device). A collective: every rank makes every stage's group, in order."""
    groups = [dist.new_group(list(range(stage * size, (stage + 1) * size))) for stage in range(stage_count)]
    return groups[stage_index]


def shard_stage(model: torch.nn.Module, rank: int, size: int, group) -> None:
    """Slice the stage model's decoder linears for `rank` of the stage's `size` ranks (all-reduces over `group`);
    ValueError naming what cannot be split (a plan style other than colwise/rowwise/replicated, a dimension the
    ranks do not divide, a model without a plan)."""
    text = model.config.get_text_config()
    plan = getattr(text, "base_model_tp_plan", None)
    if not plan:
        raise ValueError(f"{type(text).__name__} cannot be split tensor-parallel: transformers gives it no "
                         "base_model_tp_plan")
    for heads in ("num_attention_heads", "num_key_value_heads"):
        count = getattr(text, heads, None)
        if count is not None and count % size:
            raise ValueError(f"tensor_parallel_size {size} does not divide the model's {heads} ({count})")
    base = model.get_decoder()
    modules = dict(base.named_modules())
    for pattern, style in plan.items():
        if style in REPLICATED:
            continue
        if style not in ("colwise", "rowwise"):
            raise ValueError(f"{type(text).__name__}: tensor-parallel style {style!r} ({pattern}) is not served "
                             "inside a pipeline stage (colwise, rowwise and replicated are)")
        for name in fnmatch.filter(modules, pattern):
            _shard(base, name, modules[name], style, rank, size, group)


def _shard(base: torch.nn.Module, name: str, linear: torch.nn.Module, style: str, rank: int, size: int,
           group) -> None:
    if type(linear) is not torch.nn.Linear:
        raise ValueError(f"{name}: a {type(linear).__name__}, not a Linear, cannot be split tensor-parallel here")
    features = linear.out_features if style == "colwise" else linear.in_features
    if features % size:
        raise ValueError(f"{name}: tensor_parallel_size {size} does not divide its {features} features")
    if style == "rowwise":
        parent_name, _, child = name.rpartition(".")
        setattr(base.get_submodule(parent_name) if parent_name else base, child,
                RowwiseShard(linear, rank, size, group))
        return
    share = features // size
    rows = slice(rank * share, (rank + 1) * share)
    linear.weight = torch.nn.Parameter(linear.weight.detach()[rows].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = torch.nn.Parameter(linear.bias.detach()[rows].clone(), requires_grad=False)
    linear.out_features = share
