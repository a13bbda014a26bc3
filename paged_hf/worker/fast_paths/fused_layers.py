"""Fewer, larger ops per decoder layer, swapped in for the engine's steps only.

On a small model a decode step is mostly fixed per-layer costs: ~7 linears and ~25 small torch ops a layer, each
with its dispatch overhead. During a step:
- q/k/v, and gate/up, the Linears of one module that read the same input, run as one call: at a few rows the
  few-row loops over their weights as they are; past that one oneDNN matmul on a packed copy of their weights
  concatenated, once the packing switch allows (packed_linears.py), else each weight's own `F.linear` (no copy
  of any weight); quantized linears as one stacked quantized linear, one kernel call. Each projection's
  stand-in returns its slice of the output;
- an MLP whose forward is LlamaMLP's (`down(act(gate(x)) * up(x))`, SiLU) runs SiLU-and-multiply as one compiled
  op on that fused output;
- an RMSNorm whose forward is LlamaRMSNorm's runs as one compiled op (eight torch ops and two casts in bf16;
  not in float64 models, see `_not_float64`);
- an attention whose forward is LlamaAttention's rotates q and k in place in the fused q/k/v output, one compiled
  op for the ~12 of `apply_rotary_pos_emb`, then calls the attention function exactly as its own forward does
  (in a paged step, with the paged function: the output's rows go to the paged cache directly, checked as that
  function checks a call);
- a decoder layer whose forward is LlamaDecoderLayer's, and whose norms, attention and MLP are all fused, calls
  them directly and adds the residual and normalizes it in one compiled op (decoder_layers.py, with the decoder
  stack the lean path computes in one call);
- a rotary embedding whose forward is LlamaRotaryEmbedding's gives a single position's tables as its forward made
  them for that position before (rotary_table.py).
A module qualifies by its forward's code, not its class name: the transformers families copied from Llama
(Mistral, Qwen2, Qwen3, ...) share that code; anything else keeps its own forward.

As with the packed linears and the LoRA wrappers, `parent._modules[name]` is swapped for the step and restored,
so outside a step the user's model is exactly what it was; weights changed in place are concatenated again.
The same arithmetic in another order: bf16 results are rounded where torch rounds them.
"""

from __future__ import annotations

import operator

import torch
from transformers.activations import SiLUActivation
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import (LlamaAttention, LlamaDecoderLayer, LlamaMLP, LlamaRMSNorm,
                                                      LlamaRotaryEmbedding)

from paged_hf.integrations.lora import updates_over
from paged_hf.integrations.transformers import check_step_call, paged_attention_forward, step_cache
from paged_hf.kernels import layer_ops
from paged_hf.kernels.quant_linear import QuantizedLinear, linear_dtype, stack_linears, stackable
from paged_hf.kernels.q4_panels import PanelLinear
from paged_hf.kernels.quant_gemm import CompiledLayerLinear, FewRowsW4A16, FewRowsW8A8
from paged_hf.kernels.small_gemm import SmallLinear
from paged_hf.worker.attention_switch import attention_function
from paged_hf.worker.code_match import forward_globals, runs_forward_of, runs_own_class_code, same_code
from paged_hf.worker.fast_paths.decoder_layers import FusedDecoderLayer, decoder_stacks
from paged_hf.worker.fast_paths.lean_layers import LeanDecodes
from paged_hf.worker.fast_paths.packed_linears import PackingSwitch, packable_dtypes, weight_version
from paged_hf.worker.fast_paths.rotary_table import RotaryTable, keeps_positions
from paged_hf.worker.stand_ins import ModuleSwaps, StandIn

#: sibling Linears that read the same input in the transformers models that follow Llama's layout
PROJECTION_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
SILU_TYPES = (torch.nn.SiLU, SiLUActivation)  # ACT2FN["silu"] is transformers' own class
_BATCH_HINT = 64  # as packed_linears: the batch size oneDNN lays the weights out for


class ProjectionGroup:
    """Linears reading the same input, as one matmul on their concatenated weights (quantized linears: one
    stacked quantized linear)."""

    def __init__(self, linears: list[torch.nn.Module], pack: bool, switch: PackingSwitch | None = None):
        """`pack`: lay the concatenated weight out for oneDNN where it can (as `pack_linear_weights` does), once
        `switch` allows (None: from the first call)."""
        self.linears = linears
        self.sizes = [linear.out_features for linear in linears]
        self.dtype = linear_dtype(linears[0])
        self.quantized = isinstance(linears[0], QuantizedLinear)
        self.packable = pack and not self.quantized and self.dtype in packable_dtypes()
        self.switch = switch
        self.packed: torch.Tensor | None = None  # made on the first call that packs (a copy of every weight)
        self._built_from: list | None = None
        self.small: SmallLinear | CompiledLayerLinear | None = None  # the group at a few rows (small_gemm, quant_gemm)
        self._input: torch.Tensor | None = None  # the input whose outputs wait for the other projections
        self._outputs: tuple[torch.Tensor, ...] = ()
        self._served: set[int] = set()

    def current(self) -> ProjectionGroup:
        """The group on its linears' weights as they are now (built again when one was changed or replaced)."""
        if self._built_from is None or any(a is not b or u != v for (a, u), (b, v) in zip(self._versions(),
                                                                                          self._built_from)):
            self._build()
            self._built_from = self._versions()  # after: a stack of quantized linears re-points their weights
        return self

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The fused projection of x: [..., sum of the out_features]."""
        self.current()
        if self.quantized:  # switched as the linears are now (the engine probe computes W8A8 as W8A16)
            self.stack.take_modes(self.linears[0])
            return self.stack(x)
        if self.small is not None and self.small.serves(x):  # a few rows: the weights as they are, read once
            return self.small(x)
        if self.packable and (self.switch is None or self.switch.packs(self.dtype)):
            if self.packed is None:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(torch.cat(self.weights), _BATCH_HINT)
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return torch.cat([torch.nn.functional.linear(x, weight, bias)  # (the outputs are small beside the weights)
                          for weight, bias in zip(self.weights, self.biases)], dim=-1)

    def _versions(self) -> list[tuple[torch.Tensor | None, tuple | None]]:
        """Each linear's weight and bias with `weight_version`: what the group's copies and pointers hold."""
        tensors = [t for linear in self.linears for t in (linear.qweight if self.quantized else linear.weight,
                                                         linear.bias)]
        return [(t, None if t is None else weight_version(t)) for t in tensors]

    def _build(self) -> None:
        if self.quantized:
            self.stack = stack_linears(self.linears)
            # W4A8 panels, a bf16 W8A8 or W4A16 call: the compiled decode layer's (only)
            stack, modes_of = self.stack, self.linears[0]
            self.small = (PanelLinear.of(stack, modes_of) or FewRowsW8A8.of(stack, modes_of)
                          or FewRowsW4A16.of(stack, modes_of))
            return
        weights, biases = [linear.weight.detach() for linear in self.linears], [linear.bias for linear in self.linears]
        self.small = SmallLinear(weights, biases) if SmallLinear.usable(weights, biases) else None
        self.weights, self.biases, self.packed = weights, biases, None
        self.bias = None if biases[0] is None else torch.cat([bias.detach() for bias in biases])

    def output(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """Projection `index` of x: computed with its siblings on the first call for this x, then handed out."""
        if self._input is not x or index in self._served:
            self._outputs = self(x).split(self.sizes, dim=-1)
            self._input, self._served = x, set()
        self._served.add(index)
        output = self._outputs[index]
        if len(self._served) == len(self.sizes):  # every sibling has its slice: hold nothing past the layer
            self.release()
        return output

    def release(self) -> None:
        self._input, self._outputs = None, ()


class ProjectionSlice(StandIn):
    """One projection of a group. `base` is the user's Linear (the LoRA wrappers compute on top of `self`)."""

    def __init__(self, base: torch.nn.Linear, group: ProjectionGroup, index: int):
        super().__init__(base)
        object.__setattr__(self, "base", base)  # not a submodule: nothing registered twice
        object.__setattr__(self, "group", group)
        self.index = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.group.dtype:  # its own call: F.linear refuses such an x, a quantized linear converts it
            return self.base(x)
        return self.group.output(x, self.index)


class _AroundGroup(StandIn):
    """A module (`owner`) whose forward is rewritten around the projection group of its Linears `names`."""

    def __init__(self, owner: torch.nn.Module, names: tuple[str, ...], group: ProjectionGroup,
                 slices: tuple[ProjectionSlice, ...]):
        super().__init__(owner)
        object.__setattr__(self, "owner", owner)  # not submodules: nothing registered twice
        object.__setattr__(self, "group", group)
        self.names, self.slices = names, slices
        self.modules_at = operator.itemgetter(*names)  # -> the modules installed at `names` (two or more)

    def projection(self, x: torch.Tensor):
        """x -> [..., sum of the out_features] this step: the group's matmul, with the step's LoRA updates added
        where wrappers are over the stand-ins; None where the installed modules must compute themselves (an input
        F.linear refuses, LoRA wrappers that record or are not grouped yet)."""
        if x.dtype != self.group.dtype:
            return None
        installed = self.modules_at(self.owner._modules)
        if installed == self.slices:
            return self.group
        add_updates = updates_over(installed, self.slices)
        return None if add_updates is None else lambda x: self._with_updates(x, add_updates)

    def _with_updates(self, x: torch.Tensor, add_updates) -> torch.Tensor:
        output = self.group(x)
        add_updates(output.split(self.group.sizes, dim=-1), x)
        return output

    def packed_output(self, x: torch.Tensor) -> torch.Tensor | None:
        """`projection(x)` of x, or None."""
        project = self.projection(x)
        return None if project is None else project(x)


class FusedMLP(_AroundGroup):
    """LlamaMLP's forward with gate/up as one matmul and SiLU-and-multiply as one compiled op."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mlp = self.owner
        packed = self.packed_output(x)
        if packed is not None:
            gate, up = packed.split(self.group.sizes, dim=-1)
        else:  # what the installed modules give (LoRA wrappers computing alone, an input F.linear refuses)
            gate, up = mlp.gate_proj(x), mlp.up_proj(x)
        hidden = layer_ops.silu_and_mul(gate, up)
        if hidden is None:
            hidden = mlp.act_fn(gate) * up
        return mlp.down_proj(hidden)


class FusedAttention(_AroundGroup):
    """LlamaAttention's forward with q/k/v as one matmul and the rotary embedding as one in-place compiled op."""

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None, cache=None,
                **kwargs):
        attention = self.owner
        if "past_key_values" in kwargs:  # the deprecated spelling: the model's own forward renames it
            return type(attention).forward(attention, hidden_states, position_embeddings, attention_mask, cache,
                                           **kwargs)
        input_shape, head_dim = hidden_states.shape[:-1], attention.head_dim
        cos, sin = position_embeddings
        qkv = self.packed_output(hidden_states)
        if qkv is not None:
            sizes = self.group.sizes
            rotated = [layer_ops.rotate_in_place(qkv, cos, sin, (sizes[0] + sizes[1]) // head_dim, head_dim)] * 2
            paged = self._paged_rows(qkv, rotated[0], attention_mask, cache, kwargs)
            if paged is not None:
                return attention.o_proj(paged.view(*input_shape, -1)), None
            parts = qkv.split(sizes, dim=-1)
        else:  # what the installed modules give (fresh tensors), q and k rotated one by one
            parts = [attention._modules[name](hidden_states) for name in self.names]
            rotated = [layer_ops.rotate_in_place(part, cos, sin, part.shape[-1] // head_dim, head_dim)
                       for part in parts[:2]]
        hidden_shape = (*input_shape, -1, head_dim)
        query, key, value = (part.view(hidden_shape).transpose(1, 2) for part in parts)
        if not all(rotated):  # HF's rotary for what the compiled op did not rotate
            rotated_query, rotated_key = modeling_llama.apply_rotary_pos_emb(query, key, cos, sin)
            query, key = (query if rotated[0] else rotated_query), (key if rotated[1] else rotated_key)
        if cache is not None:
            key, value = cache.update(key, value, attention.layer_idx, kwargs=kwargs)
        attention_interface = attention_function(attention, modeling_llama.eager_attention_forward)
        output, weights = attention_interface(attention, query, key, value, attention_mask,
                                              dropout=0.0 if not attention.training else attention.attention_dropout,
                                              scaling=attention.scaling, **kwargs)
        output = output.reshape(*input_shape, -1).contiguous()
        return attention.o_proj(output), weights

    def _paged_rows(self, qkv: torch.Tensor, rotated: bool, attention_mask, cache, kwargs) -> torch.Tensor | None:
        """In a paged step whose attention function is the paged one: the fused q/k/v output's rows straight to
        the paged cache (`PagedCache.write_and_attend`), [num_tokens, num_heads, head_dim] out, checked as the
        paged attention function checks its calls; None where the call must go through the function."""
        attention = self.owner
        if (not rotated or cache is None or step_cache() is not cache or not qkv.is_contiguous()
                or attention_function(attention, None) is not paged_attention_forward):
            return None
        check_step_call(attention, attention_mask, attention.attention_dropout, kwargs)
        rows = qkv.view(-1, qkv.shape[-1])
        query, key, value = (part.view(rows.shape[0], -1, attention.head_dim)
                             for part in rows.split(self.group.sizes, dim=-1))
        return cache.write_and_attend(attention, query, key, value, scaling=attention.scaling)


class FusedRMSNorm(StandIn):
    """LlamaRMSNorm's forward as one compiled op (its own forward where the op cannot serve the input)."""

    def __init__(self, norm: torch.nn.Module):
        super().__init__(norm)
        object.__setattr__(self, "norm", norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = layer_ops.rms_norm(x, self.norm.weight, self.norm.variance_epsilon)
        return self.norm(x) if out is None else out


class FusedLayers(ModuleSwaps):
    """Every qualifying projection group, MLP and RMSNorm of the model, swapped for its fused stand-in in a step."""

    def __init__(self, model: torch.nn.Module, pack: bool = True, switch: PackingSwitch | None = None):
        """`pack`, `switch`: whether the groups' float weights are packed for oneDNN, and from when."""
        self.pack, self.switch = pack, switch
        self.lean = LeanDecodes()
        self.sites = []
        self.groups: list[ProjectionGroup] = []
        if (getattr(model, "tp_size", None) or 1) > 1:  # weight shards (DTensors): left to torch
            return
        for parent in list(model.modules()):
            for names in PROJECTION_GROUPS:
                self._add_group(parent, names)
            for name, child in parent._modules.items():
                if runs_forward_of(child, LlamaRMSNorm) and _on_cpu(child) and _not_float64(child):
                    self.sites.append((parent, name, child, FusedRMSNorm(child)))
                elif runs_forward_of(child, LlamaRotaryEmbedding) and keeps_positions(child):
                    self.sites.append((parent, name, child, RotaryTable(child)))
        self._add_mlps(model)
        self._add_decoder_layers(model)

    def stacked_weights(self) -> list[torch.Tensor]:
        """The quantized groups' stacked buffers (made now where not yet): weights the engine holds beside the
        model's modules (the linears' buffers are their rows)."""
        return [buffer for group in self.groups if group.quantized for buffer in group.current().stack.buffers()]

    @property
    def fused_linears(self) -> set[int]:
        """ids of the Linears computed by a group (the packed linears leave them alone)."""
        return {id(linear) for group in self.groups for linear in group.linears}

    def _add_group(self, parent: torch.nn.Module, names: tuple[str, ...]) -> None:
        linears = [parent._modules.get(name) for name in names]
        if all(_quantized_on_cpu(linear) for linear in linears):
            if not stackable(linears) or linears[0].dtype == torch.float64:  # see _quantized_on_cpu
                return
        elif not all(_plain_linear(linear) for linear in linears):
            return
        first = linears[0]
        if any(linear.in_features != first.in_features or linear_dtype(linear) != linear_dtype(first)
               or (linear.bias is None) != (first.bias is None) for linear in linears):
            return
        group = ProjectionGroup(linears, self.pack, self.switch)
        self.groups.append(group)
        for index, (name, linear) in enumerate(zip(names, linears)):
            self.sites.append((parent, name, linear, ProjectionSlice(linear, group, index)))

    def _add_mlps(self, model: torch.nn.Module) -> None:
        """The MLPs and attentions around the groups, where their forwards are Llama's."""
        slices = {(id(parent), name): stand_in for parent, name, _, stand_in in self.sites}
        for parent in list(model.modules()):
            for name, child in parent._modules.items():
                gate, up = slices.get((id(child), "gate_proj")), slices.get((id(child), "up_proj"))
                if (gate is not None and up is not None and gate.group is up.group
                        and runs_forward_of(child, LlamaMLP) and _silu(getattr(child, "act_fn", None))):
                    stand_in = FusedMLP(child, PROJECTION_GROUPS[1], gate.group, (gate, up))
                    self.sites.append((parent, name, child, stand_in))
                qkv = tuple(slices.get((id(child), projection)) for projection in PROJECTION_GROUPS[0])
                if (all(qkv) and len({id(s.group) for s in qkv}) == 1 and _runs_llama_attention(child)
                        and all(size % child.head_dim == 0 for size in qkv[0].group.sizes)):
                    stand_in = FusedAttention(child, PROJECTION_GROUPS[0], qkv[0].group, qkv)
                    self.sites.append((parent, name, child, stand_in))

    def _add_decoder_layers(self, model: torch.nn.Module) -> None:
        """Llama's decoder layers whose norms, attention and MLP all have fused stand-ins."""
        stand_ins = {(id(parent), name): stand_in for parent, name, _, stand_in in self.sites}
        kinds = {"input_layernorm": FusedRMSNorm, "self_attn": FusedAttention, "post_attention_layernorm": FusedRMSNorm,
                 "mlp": FusedMLP}
        for parent in list(model.modules()):
            for name, child in parent._modules.items():
                parts = {part: stand_ins.get((id(child), part)) for part in kinds}
                if runs_forward_of(child, LlamaDecoderLayer) and all(isinstance(parts[part], kind)
                                                                   for part, kind in kinds.items()):
                    self.sites.append((parent, name, child, FusedDecoderLayer(child, parts, self.lean)))
        self.lean.stacks.update(decoder_stacks(model, self.sites))

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self.lean.end_step()
        for group in self.groups:
            group.release()


def _runs_llama_attention(module: torch.nn.Module) -> bool:
    """LlamaAttention's forward (under the same decorators) with Llama's rotary functions in its module."""
    if not runs_forward_of(module, LlamaAttention):
        return False
    space = forward_globals(module)
    return all(same_code(space.get(name), getattr(modeling_llama, name))  # the names its code calls
               for name in ("apply_rotary_pos_emb", "rotate_half"))


def _silu(activation) -> bool:
    """transformers' SiLU (or torch's), computing its own class's code (no hub kernel in it)."""
    return isinstance(activation, SILU_TYPES) and runs_own_class_code(activation)


def _not_float64(norm: torch.nn.Module) -> bool:
    """float64 is the reference dtype, where HF's RMSNorm still sums in float32: a reordered float32 sum would
    show at 1e-7, far above float64's noise, so float64 models keep HF's own norm (bitwise their logits)."""
    return all(p.dtype != torch.float64 for p in norm.parameters(recurse=False))


def _on_cpu(module: torch.nn.Module) -> bool:
    return all(p.device.type == "cpu" for p in module.parameters(recurse=False))


def _quantized_on_cpu(module: torch.nn.Module | None) -> bool:
    """One of paged_hf's quantized linears (kernels.quant_linear) in CPU memory, with no hooks. A float64
    model keeps them one by one, HF's ops around them: they compute in float32, where a stack's zero-point matmul
    (its column count) or a compiled op's last float64 bit shows at 1e-7 of the logits, not float64's 1e-16."""
    return isinstance(module, QuantizedLinear) and runs_own_class_code(module) and module.qweight.device.type == "cpu"


def _plain_linear(module: torch.nn.Module | None) -> bool:
    """A plain Linear with its weight in CPU memory: not a subclass (peft, quantized layers), not offloaded or
    dispatched by accelerate hooks, no hooks of its own."""
    if type(module) is not torch.nn.Linear or not runs_own_class_code(module):
        return False
    weight = module.weight
    return type(weight) in (torch.nn.Parameter, torch.Tensor) and weight.device.type == "cpu" and weight.dim() == 2
