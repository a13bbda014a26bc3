"""A lean decoder layer as one compiled call (`kernels/csrc/lean_layer.cpp`), where every linear of the layer is
served by the few-row loops (a decode step of one or a few requests) and nothing of it computes itself in Python;
and where every layer of the model's decoder stack is, the whole stack as one call (`NativeStep.call_stack`).

Why: at one row a lean layer's dozen kernels take a few microseconds each, and each of their Python calls (ctypes'
argument conversion, pointers and shapes read again, the buffers) several times that; on the default model those
calls were ~100 us of a layer's CPU time, ~3 ms of a token. The compiled layer calls the same entry points with the
same arguments in the same order, so the layer's output is the lean path's bit for bit
(tests/worker/fast_paths/test_lean_layers.py). What it reads is handed over as structs made once: a layer's (its
weights' and norms' addresses, its cache), kept while they stay the same objects, and a step's (its rows, rotary
tables, slots, the decode's sequences and the buffers the layers share). The stack's call runs the same layer
function layer after layer (each output the next one's input): the per-layer Python it saves was ~18% of a
batch-1 bf16 token on the default model (py-spy, one thread).
"""

from __future__ import annotations

import ctypes
import functools
from typing import NamedTuple

import torch

from paged_hf import profiling
from paged_hf.kernels import layer_ops, native, small_gemm
from paged_hf.kernels.q4_panels import PanelLinear
from paged_hf.kernels.quant_gemm import CompiledLayerLinear, FewRowsW4A16, FewRowsW8A8
from paged_hf.kernels.quant_linear import Int4Linear, Int8Linear
from paged_hf.kernels.small_gemm import MAX_ROWS_AVX512, SmallLinear
from paged_hf.worker.code_match import runs_own_class_code
from paged_hf.worker.fast_paths.packed_linears import PackedLinear

_P, _I, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double


class _Linear(ctypes.Structure):
    _fields_ = [("weights", _P), ("rows", _P), ("biases", _P), ("count", _I), ("in_features", _I),
                ("out_features", _I), ("gemm", _P)]


class _Kernels(ctypes.Structure):
    _fields_ = [("rms", _P), ("add_rms", _P), ("silu", _P), ("rotary_write", _P), ("gemm", _P)]


class _Layer(ctypes.Structure):
    _fields_ = [("norm0", _P), ("norm1", _P), ("eps0", _D), ("eps1", _D), ("qkv", _Linear), ("o", _Linear),
                ("gate_up", _Linear), ("down", _Linear), ("heads", _I), ("kv_heads", _I), ("head_dim", _I),
                ("scaling", _D), ("key_cache", _P), ("value_cache", _P), ("block_size", _I), ("decode", _P),
                ("decode_in_place", _I)]


class _Step(ctypes.Structure):
    _fields_ = [("tokens", _I), ("hidden", _I), ("cos", _P), ("sin", _P), ("slots", _P), ("block_tables", _P),
                ("context_lens", _P), ("seq_starts", _P), ("num_seqs", _I), ("max_blocks", _I), ("normed", _P),
                ("residual", _P), ("rows", _P), ("query", _P), ("attended", _P), ("projected", _P), ("gate_up", _P),
                ("activated", _P), ("threads", ctypes.c_int)]


class TailStruct(ctypes.Structure):  # the model's final norm and LM head after the stack (stack_tail.py)
    _fields_ = [("norm", _P), ("eps", _D), ("head", _Linear), ("kept", _P), ("count", _I), ("normed", _P),
                ("logits", _P)]


#: the stack's status where the tail was given a kept row index out of the step's rows
TAIL_INDEX_OUT_OF_RANGE = -7


#: the most rows any few-row kernel takes (a step's rows past it are never compiled; each layer's linears are
#: checked against their own kernels' `max_rows`: W4A8, W8A8 and W4A16 take 8, float linears 2-8 by dtype and ISA)
MOST_ROWS = max(*MAX_ROWS_AVX512.values(), PanelLinear.max_rows, FewRowsW8A8.max_rows, FewRowsW4A16.max_rows)


def _address(function) -> int:
    return ctypes.cast(function, ctypes.c_void_p).value


class _Entry(NamedTuple):
    layer: ctypes._CFuncPtr  # (kernels, layer, step, x, out)
    stack: ctypes._CFuncPtr  # (kernels, layers, count, step, x, out, two [tokens, hidden] buffers, tail or null)
    kernels: _Kernels


@functools.lru_cache(maxsize=None)
def entry_point(dtype: torch.dtype) -> _Entry | None:
    """The compiled layer and stack for bfloat16/float32 rows with their kernels' struct, or None (no compiler, no
    few-row loops, another dtype)."""
    ops, small = layer_ops.row_ops(dtype), small_gemm.functions().get(dtype)
    if ops is None or small is None:
        return None
    library = native.load_or_warn(native.load_lean_layer, "a decode layer in one call")
    if library is None:
        return None
    name = "bfloat16" if dtype == torch.bfloat16 else "float32"
    kernels = _Kernels(*(_address(f) for f in (ops.rms, ops.add_rms, ops.silu, ops.rotary_write, small)))
    return _Entry(native.entry_point(library, f"lean_layer_{name}", [_P, _P, _P, _P, _P]),
                  native.entry_point(library, f"lean_stack_{name}", [_P, _P, _I, _P, _P, _P, _P, _P]), kernels)


def linear_struct(small) -> _Linear:
    """A linear's struct; a W4A8 one names its own entry point (null: the kernels' gemm)."""
    return _Linear(*small.segments(), small.in_features, small.out_features, getattr(small, "gemm", None))


def few_rows_of(linear) -> SmallLinear | CompiledLayerLinear | None:
    """What the compiled layer calls for o_proj / down_proj: a packed float linear's few-row loops, a W4A8
    linear's panels (kernels/q4_panels.py), a bf16 W4A16 or W8A8 linear's call (exactly those classes, no hooks);
    None: the layer is not compiled."""
    if type(linear) is PackedLinear:
        return linear.small_linear()
    if type(linear) is Int4Linear and runs_own_class_code(linear):
        return PanelLinear.of(linear) or FewRowsW4A16.of(linear)
    if type(linear) is Int8Linear and runs_own_class_code(linear):
        return FewRowsW8A8.of(linear)
    return None


class NativeLayers:
    """The compiled layer's structs: each layer's, kept across steps while what it points at stays (by identity),
    and the step's, made at its first layer."""

    def __init__(self):
        self.layers: dict = {}  # (layer, cache) -> (what it was made from, _Layer)
        self.enabled = True  # (tests turn it off to compare with the lean path's calls)
        self.stacks_enabled = True  # (tests turn it off to compare with one call per layer)
        self.layers_served = self.stacks_served = self.stack_plans_made = 0  # counts, for tests and benchmarks
        self._stack: tuple[tuple, ctypes.Array] | None = None  # (the layers' structs, their array) of the last stack
        self.stack_plan = None  # the last step's stack call, kept while it holds (lean_layers.StackPlan)
        self.settled: object | None = None  # the running call's token, where its model runs no code of its own

    def layer_struct(self, key, module, smalls: tuple, norms: tuple, cache, slot: int, decode) -> _Layer:
        key_cache, value_cache = cache.key_cache[slot], cache.value_cache[slot]
        sources = (*smalls, norms[0].weight, norms[1].weight, key_cache, value_cache, decode.function)
        norm_addresses = (norms[0].weight.data_ptr(), norms[1].weight.data_ptr())  # (`.data =` keeps the tensor)
        made = self.layers.get(key)
        if (made is None or len(made[0]) != len(sources) or any(a is not b for a, b in zip(made[0], sources))
                or made[2] != norm_addresses):
            qkv, o, gate_up, down = smalls
            heads = o.in_features // module.head_dim
            struct = _Layer(norms[0].weight.data_ptr(), norms[1].weight.data_ptr(), norms[0].variance_epsilon,
                            norms[1].variance_epsilon, linear_struct(qkv), linear_struct(o),
                            linear_struct(gate_up), linear_struct(down),
                            heads, key_cache.shape[2], module.head_dim, module.scaling, key_cache.data_ptr(),
                            value_cache.data_ptr(), key_cache.shape[1], _address(decode.function),
                            int(decode.in_place))
            made = self.layers[key] = (sources, struct, norm_addresses)
        return made[1]

    def stack_array(self, structs: tuple[_Layer, ...]) -> ctypes.Array:
        """The layers' structs side by side, as the stack's call reads them (kept while they are the same)."""
        if self._stack is None or len(self._stack[0]) != len(structs) or any(
                a is not b for a, b in zip(self._stack[0], structs)):
            self._stack = (structs, (_Layer * len(structs))(*structs))
        return self._stack[1]


class NativeStep:
    """A step's compiled layers: the step's struct and buffers for each set of layer sizes."""

    def __init__(self, lean_step, dtype: torch.dtype):
        self.lean, self.dtype = lean_step, dtype
        self.entry = entry_point(dtype)
        self.steps: dict[tuple, tuple[_Step, tuple]] = {}

    def serves(self, x: torch.Tensor) -> bool:
        """x's rows are at most the few-row kernels' (`MOST_ROWS`; each layer's own in `smalls_of`), and no
        profiler asks for the layer's kernels one by one."""
        return self.entry is not None and x.shape[1] <= MOST_ROWS and not profiling.active()

    @staticmethod
    def smalls_of(groups: tuple, linears: tuple, x: torch.Tensor) -> tuple | None:
        """The layer's q/k/v, o, gate/up and down as the few-row loops compute them on x's rows, or None: a linear
        that is not the few-row loops', or more rows than one of them takes (`max_rows`)."""
        smalls = (groups[0].current().small, few_rows_of(linears[0]), groups[1].current().small,
                  few_rows_of(linears[1]))
        if (None in smalls or x.shape[1] > min(small.max_rows for small in smalls)
                or not all(small.serves(x) for small in smalls[::2])):  # (o and down: of the same rows)
            return None
        return smalls

    def run(self, layers: NativeLayers, layer, module, groups: tuple, linears: tuple, norms: tuple, slot: int,
            decode, x: torch.Tensor) -> torch.Tensor | None:
        """The layer's output for x [1, tokens, hidden], or None where a linear is not the few-row loops'."""
        smalls = self.smalls_of(groups, linears, x)
        if smalls is None:
            return None
        lean = self.lean
        struct = layers.layer_struct((layer, lean.cache), module, smalls, norms, lean.cache, slot, decode)
        step, buffers = self._step(decode, x, struct)
        lean.cache.books.serve(module.layer_idx, buffers[0])
        out = torch.empty_like(x)
        status = self.entry.layer(ctypes.byref(self.entry.kernels), ctypes.byref(struct), ctypes.byref(step),
                                  x.data_ptr(), out.data_ptr())  # (no profiler range: a profiled step is per call)
        if status != 0:
            raise RuntimeError(f"the compiled decode layer failed (status {status})")
        layers.layers_served += 1
        return out

    def stack_structs(self, layers: NativeLayers, plans: list[tuple], x: torch.Tensor) -> tuple | None:
        """(the layers' structs for the stack's call, the most rows all their linears take); `plans`: each layer's
        (layer, module, groups, linears, norms, slot, decode) in the model's order. None where a layer's linear is
        not the few-row loops' or the layers' sizes differ (the stack shares one step struct)."""
        cache, structs, sizes, max_rows = self.lean.cache, [], None, MOST_ROWS
        for layer, module, groups, linears, norms, slot, decode in plans:
            smalls = self.smalls_of(groups, linears, x)
            if smalls is None or (sizes is not None and sizes != tuple(s.out_features for s in smalls)):
                return None
            sizes = tuple(small.out_features for small in smalls)
            max_rows = min(max_rows, *(small.max_rows for small in smalls))
            structs.append(layers.layer_struct((layer, cache), module, smalls, norms, cache, slot, decode))
        return tuple(structs), max_rows

    def call_stack(self, layers: NativeLayers, structs: tuple, plans: list[tuple], decode, x: torch.Tensor,
                   tail=None) -> torch.Tensor:
        """The decoder stack's output for x [1, tokens, hidden] in one call of the layers' `structs`; `decode`: this
        step's decode call (its sequences and block tables); `tail`: the step's StackTail (stack_tail.py), whose
        asked norm and head the call computes after the stack where it can."""
        cache = self.lean.cache
        step, buffers = self._step(decode, x, structs[0])
        for plan in plans:
            cache.books.serve(plan[1].layer_idx, buffers[0])
        out = torch.empty_like(x)
        tail_struct = tail.struct_for(x) if tail is not None else None
        status = self.entry.stack(ctypes.byref(self.entry.kernels), layers.stack_array(structs), len(structs),
                                  ctypes.byref(step), x.data_ptr(), out.data_ptr(), buffers[-1].data_ptr(),
                                  None if tail_struct is None else ctypes.byref(tail_struct))
        if status == TAIL_INDEX_OUT_OF_RANGE:
            raise IndexError(f"logits_to_keep holds an index out of range for a step of {x.shape[1]} rows")
        if status != 0:
            raise RuntimeError(f"the compiled decoder stack failed (status {status})")
        layers.layers_served += len(structs)
        layers.stacks_served += 1
        return out

    def _step(self, decode, x: torch.Tensor, struct: _Layer) -> tuple[_Step, tuple[torch.Tensor, ...]]:
        """The step's struct for the sizes of the layer `struct` and its buffers, made with it: the q/k/v rows
        first, the stack's two [tokens, hidden] buffers last."""
        sizes = (struct.qkv.out_features, struct.o.out_features, struct.gate_up.out_features, struct.o.in_features)
        made = self.steps.get(sizes)
        if made is None:
            lean, tokens = self.lean, x.shape[1]
            qkv, hidden, gate_up, q_cols = sizes
            buffers = tuple(torch.empty(tokens, width, dtype=self.dtype)
                            for width in (qkv, q_cols, q_cols, hidden, gate_up, gate_up // 2, 2 * x.shape[2]))
            rows, query, attended, projected, gate_up_rows, activated, _ = buffers
            block_tables, context_lens, seq_starts = decode.step
            step = _Step(tokens, x.shape[2], lean.cos.data_ptr(), lean.sin.data_ptr(), lean.slots.data_ptr(),
                         block_tables, context_lens, seq_starts, decode.num_seqs, decode.max_blocks,
                         lean.normed.data_ptr(), lean.residual.data_ptr(), rows.data_ptr(), query.data_ptr(),
                         attended.data_ptr(), projected.data_ptr(), gate_up_rows.data_ptr(), activated.data_ptr(),
                         torch.get_num_threads())
            made = self.steps[sizes] = (step, buffers)
        return made
