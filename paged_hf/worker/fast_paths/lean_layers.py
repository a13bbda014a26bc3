"""The fused decoder layers of a paged CPU step whose every query the decode kernel serves (its decodes, and its
prompt chunks where the kernel's tiles take them), each layer in a dozen calls, the step's checks made once.

Why: on a small model the time a decode step spends outside its matmul and attention kernels is Python, and
inside a step every Python operation costs several times what it costs in a loop of its own (the kernels between
them evict the interpreter's data). Through the stand-ins (`fused_layers`) a layer makes some forty calls, each
checking again what cannot change within a step: the cache's plan, the rotary tables, the layout of the tensors
it made itself (~300 us of a layer on the default model). Here the step's first layer checks those once
(`LeanStep.of`); each layer then checks what is its own (its modules, weights and input) and calls RMSNorm, the
q/k/v matmul, rotary and the K/V writes, decode attention reading q in place, o_proj, the residual add and
RMSNorm, the gate/up matmul, SiLU-and-multiply, down_proj and the residual add: the stand-ins' kernels with the
same arguments in the same order, so the same bits (tests/worker/fast_paths/test_lean_layers.py). Rotary and the
K/V writes are one compiled call, and what a layer's calls read and forget lives in buffers made once a step.
LoRA adapters are served here as by the stand-ins (their updates added to the fused projections), and quantized
projections (int8, 4-bit: the group's stacked quantized linear, o_proj and down_proj called as they are). A step
with a prompt chunk for another kernel, a quantized cache, adapter wrappers that must run themselves (a probing
step), or anything else checked here goes the stand-ins' way.
"""

from __future__ import annotations

import operator

import torch

from paged_hf.integrations.transformers import check_step_call, paged_attention_forward, step_cache
from paged_hf.kernels import layer_ops
from paged_hf.profiling import span
from paged_hf.worker.attention_switch import attention_function
from paged_hf.worker.fast_paths.native_layer import NativeLayers, NativeStep, few_rows_of
from paged_hf.worker.fast_paths.packed_linears import PackedLinear


class LeanDecodes:
    """Shared by a model's fused decoder layers: the step's `LeanStep`, made at its first layer; the decoder stacks
    that can run as one compiled call, and the output such a call hands on through the stack's later layers."""

    def __init__(self):
        self.enabled = True  # (tests turn it off to compare with the stand-ins' path)
        self.layers_served = 0  # a count, for tests and benchmarks
        self.fitting: dict = {}  # layer -> its shapes fit the lean calls (fixed for the model and its cache)
        self._made_for: tuple | None = None  # (the cache's step metadata, the rotary tables) it was made for
        self._step: LeanStep | None = None
        self.native = NativeLayers()  # a layer in one compiled call where its linears are the few-row loops'
        self.stacks: dict = {}  # first layer's stand-in -> DecoderStack (decoder_layers.py)
        self._passing: tuple | None = None  # (the stack's output, its layers, the next one's index)
        self.tail = None  # the step's StackTail (stack_tail.py): what the stack's call computes after it, if asked

    def run(self, layer, hidden_states: torch.Tensor, position_embeddings, attention_mask, cache,
            kwargs: dict) -> torch.Tensor | None:
        """The output of `layer` (a FusedDecoderLayer whose parts are installed), or None: not served here. At the
        first layer of a stack whose every layer the compiled layer serves: the whole stack's output, which its
        later layers hand on (`pass_on`)."""
        if not self.enabled or cache is None or not isinstance(position_embeddings, tuple):
            return None
        made_for, metadata = self._made_for, getattr(cache, "metadata", None)
        if made_for is None or made_for[0] is not metadata or made_for[1] is not position_embeddings:
            self._made_for = (metadata, position_embeddings)
            self._step = LeanStep.of(cache, hidden_states, position_embeddings, self.fitting, self.native)
        if self._step is None:
            return None
        stack = self.stacks.get(layer)
        if stack is not None and stack.installed(self.native.settled):
            output = self._step.run_stack(stack.layers, hidden_states, attention_mask, kwargs, self.tail)
            if output is not None:
                self.layers_served += len(stack.layers)
                self._passing = (output, stack.layers, 1) if len(stack.layers) > 1 else None
                return output
        output = self._step.run(layer, hidden_states, attention_mask, kwargs)
        self.layers_served += output is not None
        return output

    def pass_on(self, layer, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """The stack's output again, where `layer` is the next layer of the stack just computed in one call and is
        given that output (what the model's forward does with each layer's output); else None."""
        passing = self._passing
        if passing is None:
            return None
        output, layers, index = passing
        if hidden_states is not output or layers[index] is not layer:  # the model's own loop cannot do this
            self._passing = None
            raise RuntimeError(f"decoder layer {index} of a stack computed in one call was given other hidden "
                               f"states than the layer before it returned")
        self._passing = (output, layers, index + 1) if index + 1 < len(layers) else None
        return output

    def take_handed_on(self, layers: list, output: torch.Tensor) -> bool:
        """True where `output` is that of a stack just computed in one call whose layers are `layers` (the model's
        loop, in order): its later layers would hand it on unchanged, and a caller running that loop itself
        (llama_forward.py) skips them; the hand-on is then done."""
        passing = self._passing
        if passing is None or passing[0] is not output or passing[2] != 1 or len(passing[1]) != len(layers) \
                or not all(map(operator.is_, passing[1], layers)):
            return False
        self._passing = None
        return True

    def end_step(self) -> None:
        self._made_for = self._step = self._passing = None  # holds no tensor past the step


class LeanStep:
    """What every layer of the step shares, checked once: the cache, the rows' shape and dtype, the rotary
    tables and the slots the step's K/V go to."""

    def __init__(self, cache, ops: layer_ops.RowOps, shape: torch.Size, cos: torch.Tensor, sin: torch.Tensor,
                 fitting: dict, native_layers: NativeLayers):
        self.cache, self.ops, self.shape, self.cos, self.sin = cache, ops, shape, cos, sin
        self.slots = cache.metadata.slot_mapping
        self.fitting = fitting  # layer -> _fits, kept by LeanDecodes
        self.native_layers, self.native = native_layers, NativeStep(self, ops.dtype)
        self.paged_configs: dict[int, bool] = {}  # id of a config -> _calls_paged
        # what a layer's own calls read and forget before the next layer: made once a step, not once a layer
        self.normed, self.residual = torch.empty(shape, dtype=ops.dtype), torch.empty(shape, dtype=ops.dtype)
        self.buffers: dict[tuple, torch.Tensor] = {}  # shape -> the inputs of o_proj and down_proj

    @classmethod
    def of(cls, cache, hidden_states: torch.Tensor, position_embeddings: tuple, fitting: dict,
           native_layers: NativeLayers) -> LeanStep | None:
        """For a paged step on this thread whose hidden states are [1, tokens, hidden] contiguous CPU rows of a
        bfloat16/float32 model, with rotary tables [1, tokens, head_dim] alike; else None."""
        if step_cache() is not cache or not cache.in_step or len(position_embeddings) != 2:
            return None
        ops = layer_ops.row_ops(hidden_states.dtype)
        slots = cache.metadata.slot_mapping
        if (ops is None or hidden_states.dim() != 3 or hidden_states.shape[0] != 1 or slots.dtype != torch.int64
                or not slots.is_contiguous() or slots.device.type != "cpu" or slots.numel() != hidden_states.shape[1]
                or not cpu_rows(hidden_states, ops.dtype)):
            return None
        cos, sin = position_embeddings
        if not all(cpu_rows(t, ops.dtype) and t.shape == cos.shape and t.shape[:2] == hidden_states.shape[:2]
                   for t in (cos, sin)):
            return None
        return cls(cache, ops, hidden_states.shape, cos, sin, fitting, native_layers)

    def _plan(self, layer, x: torch.Tensor, attention_mask, kwargs: dict) -> tuple | None:
        """What the lean calls of `layer` on x read: (its attention and MLP stand-ins, its attention module, norms,
        cache slot, decode, the q/k/v and gate/up projections, o_proj, down_proj); None where they cannot serve it."""
        parts = layer.parts
        attention, mlp = parts["self_attn"], parts["mlp"]
        module, norms = attention.owner, (parts["input_layernorm"].norm, parts["post_attention_layernorm"].norm)
        cache, ops = self.cache, self.ops
        slot = cache.books.slot_of_layer.get(getattr(module, "layer_idx", None))
        decode = None if slot is None else cache.decode_rows(slot)
        if (decode is None or x.shape != self.shape or not cpu_rows(x, ops.dtype)
                or not cpu_rows(norms[0].weight, ops.dtype) or not cpu_rows(norms[1].weight, ops.dtype)
                or not self._fits(layer, module, slot) or not self._calls_paged(module)):
            return None
        qkv_of, gate_up_of = attention.projection(x), mlp.projection(x)  # (LoRA updates added, where adapters are)
        if qkv_of is None or gate_up_of is None:
            return None
        check_step_call(module, attention_mask, module.attention_dropout, kwargs)
        o_proj, down_proj = module._modules["o_proj"], mlp.owner._modules["down_proj"]
        return attention, mlp, module, norms, slot, decode, qkv_of, gate_up_of, o_proj, down_proj

    def _native_plan(self, layer, plan: tuple, x: torch.Tensor) -> tuple | None:
        """(layer, module, groups, linears, norms, slot, decode) for the compiled layer, or None: not its."""
        attention, mlp, module, norms, slot, decode, qkv_of, gate_up_of, o_proj, down_proj = plan
        if (self.native_layers.enabled and self.native.serves(x) and qkv_of is attention.group
                and gate_up_of is mlp.group and None not in (few_rows_of(o_proj), few_rows_of(down_proj))):
            return layer, module, (attention.group, mlp.group), (o_proj, down_proj), norms, slot, decode
        return None

    def run_stack(self, layers: list, x: torch.Tensor, attention_mask, kwargs: dict,
                  tail=None) -> torch.Tensor | None:
        """Every layer of a decoder stack (its stand-ins, in order) on x in one compiled call, then what `tail` (the
        step's StackTail, stack_tail.py) asks; or None: a layer the compiled layer does not serve this step (then
        each layer goes its own way, from the first). The last step's plan serves again while everything it was
        made from is as it was (`StackPlan`)."""
        native_layers = self.native_layers
        if not native_layers.stacks_enabled or not native_layers.enabled or not self.native.serves(x):
            return None
        kept = native_layers.stack_plan
        decode = None if kept is None or kept.layers is not layers else self._still_serves(kept, x, attention_mask,
                                                                                          kwargs)
        if decode is not None:
            return self.native.call_stack(native_layers, kept.structs, kept.plans, decode, x, tail)
        native_layers.stack_plan = None
        plans = []
        for layer in layers:
            plan = self._plan(layer, x, attention_mask, kwargs)
            native = None if plan is None else self._native_plan(layer, plan, x)
            if native is None:
                return None
            plans.append(native)
        made = self.native.stack_structs(native_layers, plans, x)
        if made is None:
            return None
        structs, max_rows = made
        native_layers.stack_plan = StackPlan(layers, self.cache, plans, structs, [plan[0] for plan in plans], max_rows,
                                             native_layers.settled)
        native_layers.stack_plans_made += 1
        return self.native.call_stack(native_layers, structs, plans, plans[0][-1], x, tail)

    def _still_serves(self, kept: StackPlan, x: torch.Tensor, attention_mask, kwargs: dict):
        """This step's decode call (its sequences) where the kept plan serves it: its objects as they were, each
        layer's decode function and paged attention the same, the step's call as the model makes it for every
        layer (the first one's module checked); else None."""
        if (x.shape[1] > kept.max_rows or not kept.holds(self.cache, self.native_layers.settled)
                or not all(small.serves(x) for small in kept.first_smalls)):
            return None
        decode_rows, first = self.cache.decode_rows, None
        for _, module, _, _, _, slot, decode in kept.plans:
            now = decode_rows(slot)
            if now is None or now.function is not decode.function or now.in_place != decode.in_place \
                    or not self._calls_paged(module):
                return None
            first = first or now
        check_step_call(kept.plans[0][1], attention_mask, kept.plans[0][1].attention_dropout, kwargs)
        return first

    def run(self, layer, x: torch.Tensor, attention_mask, kwargs: dict) -> torch.Tensor | None:
        plan = self._plan(layer, x, attention_mask, kwargs)
        if plan is None:
            return None
        native = self._native_plan(layer, plan, x)
        if native is not None:
            output = self.native.run(self.native_layers, *native, x)
            if output is not None:
                return output
        attention, mlp, module, norms, slot, decode, qkv_of, gate_up_of, o_proj, down_proj = plan
        ops = self.ops
        ops.rms_norm(x, norms[0].weight, norms[0].variance_epsilon, self.normed)
        rows = qkv_of(self.normed).view(x.shape[1], -1)  # [tokens, q | k | v]
        attended = self._input_of(o_proj, (x.shape[1], attention.group.sizes[0] // module.head_dim, module.head_dim))
        self._attend(module, rows, attention.group.sizes, slot, decode, attended)
        projected = _call(o_proj, attended.view(*x.shape[:-1], -1)).contiguous()
        ops.add_rms_norm(x, projected, norms[1].weight, norms[1].variance_epsilon, self.residual, self.normed)
        gate_up = gate_up_of(self.normed)
        activated = self._input_of(down_proj, (*x.shape[:-1], gate_up.shape[-1] // 2))
        ops.silu_and_mul(gate_up, activated)
        return self.residual + _call(down_proj, activated)

    def _input_of(self, linear: torch.nn.Module, shape: tuple) -> torch.Tensor:
        """A buffer of the step for the input of our packed linear (which holds nothing of it), else a new tensor
        (a hook or an adapter wrapper may keep what it is given)."""
        if type(linear) is not PackedLinear:
            return torch.empty(shape, dtype=self.ops.dtype)
        buffer = self.buffers.get(shape)
        if buffer is None:
            buffer = self.buffers[shape] = torch.empty(shape, dtype=self.ops.dtype)
        return buffer

    def _fits(self, layer, module, slot: int) -> bool:
        """q/k/v of whole heads, K and V as wide as the cache's rows, gate and up alike (kept for each layer and its
        cache), the rotary tables of this head_dim."""
        fits = self.fitting.get((layer, self.cache))
        if fits is None:
            q_size, k_size, v_size = layer.parts["self_attn"].group.sizes
            key_cache, value_cache, head_dim = self.cache.key_cache[slot], self.cache.value_cache[slot], module.head_dim
            gate_size, up_size = layer.parts["mlp"].group.sizes
            fits = self.fitting[layer, self.cache] = (
                key_cache.shape[3] == value_cache.shape[3] == head_dim and key_cache.shape[2] == value_cache.shape[2]
                and q_size % head_dim == 0 and k_size == v_size == key_cache.shape[2] * head_dim
                and gate_size == up_size)
        return fits and self.cos.shape[-1] == module.head_dim

    def _calls_paged(self, module) -> bool:
        """Its forward would call the paged attention function (made once a step for each config)."""
        config = module.config
        paged = self.paged_configs.get(id(config))
        if paged is None:
            paged = self.paged_configs[id(config)] = attention_function(module, None) is paged_attention_forward
        return paged

    def _attend(self, module, rows: torch.Tensor, sizes: list[int], slot: int, decode, out: torch.Tensor) -> None:
        """q and k rotated in place, K/V written to the step's slots, q attended -> out [tokens, heads, head_dim]."""
        cache, head_dim = self.cache, module.head_dim
        key_cache, value_cache = cache.key_cache[slot], cache.value_cache[slot]
        cache.books.serve(module.layer_idx, rows)
        self.ops.rotate_and_write(rows, self.cos, self.sin, (sizes[0] + sizes[1]) // head_dim, sizes[0], key_cache,
                                  value_cache, self.slots)
        with span("attention"):
            decode(rows, sizes[0] // head_dim, key_cache, value_cache, module.scaling, out)


_MISSING = object()
#: the plain attributes the stack's checks and structs read, by the role of the module that has them
_ATTENTION_ATTRIBUTES = ("training", "scaling", "head_dim", "layer_idx", "attention_dropout")
_NORM_ATTRIBUTES = ("variance_epsilon",)
_LINEAR_ATTRIBUTES = ("act_quant", "use_kernel")  # a quantized linear's kernel switches (kernels/quant_linear.py)


class StackPlan:
    """The compiled stack call of a step (each layer's plan and struct), kept for the next steps while everything
    its checks read is as it was: every module they walk (the layers' attention and MLP owners, their linears, the
    quantized stacks, the norms) with its submodules, parameters, buffers and the flags its role reads at their
    places (by identity), every tensor's data where they were and unchanged in place (address and version: a
    `.data =` keeps the tensor). Checking that is a few passes of C-level comparisons (~0.02 ms alone on the
    default model; ~0.4 ms in a float32 step, where the weights' read has evicted what they touch) where making
    the plan again is ~2 ms of Python; a step that differs (an adapter's wrappers, a replaced weight or its data,
    a switched flag) makes it again."""

    def __init__(self, layers: list, cache, plans: list[tuple], structs: tuple, parts: list, max_rows: int,
                 settled: object | None = None):
        self.layers, self.cache, self.plans, self.structs = layers, cache, plans, structs
        self.settled = settled  # the call whose model it was made from or last checked in full (call_scope.py)
        self.checks = 0  # checks in full, for tests
        self.max_rows = max_rows  # the most rows every layer's linears take
        self.first_smalls = plans[0][2][0].small, plans[0][2][1].small
        roles = {}  # module -> the attributes read of it (each module once, in order)
        for layer in parts:
            attention, mlp = layer.parts["self_attn"], layer.parts["mlp"]
            roles[attention.owner], roles[mlp.owner] = _ATTENTION_ATTRIBUTES, ()
            for name in ("input_layernorm", "post_attention_layernorm"):
                roles[layer.parts[name].norm] = _NORM_ATTRIBUTES
            linears = [*attention.group.linears, *mlp.group.linears,
                       *(getattr(group, "stack", None) for group in (attention.group, mlp.group)),
                       *(getattr(module, "base", module) for module in (attention.owner._modules["o_proj"],
                                                                         mlp.owner._modules["down_proj"]))]
            roles.update((linear, _LINEAR_ATTRIBUTES) for linear in linears if linear is not None)
        tables, names, values, self.tensors, self.versioned = [], [], [], [], []
        for module, attribute_names in roles.items():
            attributes = module.__dict__  # (torch keeps a module's tables there)
            for name in attribute_names:
                tables.append(attributes), names.append(name), values.append(attributes.get(name, _MISSING))
            for table in (attributes["_modules"], attributes["_parameters"], attributes["_buffers"]):
                for name, value in table.items():
                    tables.append(table), names.append(name), values.append(value)
                    if isinstance(value, torch.Tensor):
                        self.tensors.append(value)
                        if not value.is_inference():  # (an inference tensor counts no versions)
                            self.versioned.append(value)
        self.entries = tables, names, [_MISSING] * len(names), values
        self.versions, self.addresses = list(map(_VERSION, self.versioned)), list(map(_ADDRESS, self.tensors))

    def holds(self, cache, settled: object | None = None) -> bool:
        """The cache and every entry as they were, every tensor's data where they were and not changed in place
        (packed_linears.weight_version; maps over C functions: ~25 ns an entry). A later step of the call whose
        token `settled` is (not None) checks the cache only: its model ran no code that could change them."""
        if settled is not None and settled is self.settled:
            return cache is self.cache
        self.checks += 1
        tables, names, missing, values = self.entries
        holds = (cache is self.cache and all(map(operator.is_, map(dict.get, tables, names, missing), values))
                 and list(map(_VERSION, self.versioned)) == self.versions
                 and list(map(_ADDRESS, self.tensors)) == self.addresses)
        self.settled = settled if holds else None
        return holds


_VERSION, _ADDRESS = operator.attrgetter("_version"), torch.Tensor.data_ptr


def cpu_rows(x: torch.Tensor, dtype: torch.dtype) -> bool:
    """x is contiguous CPU memory of `dtype` (what the compiled calls read by address)."""
    return x.dtype == dtype and x.is_contiguous() and x.is_cpu


def _call(linear: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """linear(x); our packed stand-in's forward called directly, as the fused layer calls its parts."""
    return linear.forward(x) if type(linear) is PackedLinear else linear(x)
