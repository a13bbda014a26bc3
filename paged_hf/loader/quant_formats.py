"""Quantized checkpoints' formats: which linears a folder quantizes and how, read from its `quantization_config`,
and each quantized linear built from the folder's own tensors (kernels/quant_linear.py's modules).

Served:
- compressed-tensors (llm-compressor's output): `int-quantized` / `naive-quantized` int8 weights per output
  channel (or per tensor), with dynamic per-token symmetric int8 activations (W8A8) or none (W8A16);
  `pack-quantized` 4-bit weights in groups (or per channel), with or without zero points (W4A16), and 8-bit
  (W8A16).
- GPTQ (`quant_method: gptq`, AutoGPTQ / GPTQModel, checkpoint formats `gptq` and `gptq_v2`) and AWQ
  (`quant_method: awq`, version `gemm`): 4-bit weights in groups with zero points.
Anything else is refused with an error naming what it is (act-order, static activation scales, fp8, ...).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from paged_hf.kernels.quant_linear import Int4Linear, Int8Linear, QuantizedLinear

#: AWQ's order of the 8 columns packed in one int32 (nibble i holds column AWQ_ORDER[i] of the 8)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


class UnsupportedQuantization(ValueError):
    """A quantized checkpoint this engine does not serve; the message names the scheme."""


@dataclass(frozen=True)
class Scheme:
    """How one linear is stored and computed."""

    method: str  # "compressed-tensors" | "gptq" | "awq"
    weight_bits: int
    group_size: int | None  # None: per output channel (or per tensor, int8)
    act_quant: bool  # W8A8: dynamic per-token int8 activations
    symmetric: bool = True
    format: str = ""  # compressed-tensors' format; GPTQ's checkpoint_format; AWQ's version

    @property
    def name(self) -> str:
        return f"w{self.weight_bits}a{8 if self.act_quant else 16}"


class QuantizationConfig:
    """A folder's `quantization_config`: the scheme of each linear (None: left as it is)."""

    def __init__(self, config: dict):
        self.raw = dict(config)
        self.method = str(config.get("quant_method", "")).lower()
        if self.method == "compressed-tensors":
            self.groups, self.ignore = _compressed_tensors_groups(config)
        elif self.method in ("gptq", "awq"):
            self.groups, self.ignore = [(["Linear"], _gptq_awq_scheme(self.method, config))], []
        else:
            raise UnsupportedQuantization(f"quantization method {self.method or config!r} is not served (served: "
                                          "compressed-tensors, gptq, awq)")

    def scheme_of(self, name: str, module: torch.nn.Module) -> Scheme | None:
        if any(_matches(target, name, module) for target in self.ignore):
            return None
        for targets, scheme in self.groups:
            if any(_matches(target, name, module) for target in targets):
                return scheme
        return None

    def describe(self) -> str:
        return ", ".join(sorted({scheme.name for _, scheme in self.groups}))


def _matches(target: str, name: str, module: torch.nn.Module) -> bool:
    """compressed-tensors' rule: a class name, "re:<regex>" on the module's path, or the path itself."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == type(module).__name__ or target == name or (target == "Linear" and isinstance(module, torch.nn.Linear))


def _compressed_tensors_groups(config: dict) -> tuple[list, list]:
    fmt = config.get("format") or "int-quantized"
    if fmt not in ("int-quantized", "naive-quantized", "pack-quantized"):
        raise UnsupportedQuantization(f"compressed-tensors format {fmt!r} is not served (served: int-quantized, "
                                      "naive-quantized, pack-quantized)")
    if config.get("sparsity_config") or config.get("transform_config"):
        raise UnsupportedQuantization("compressed-tensors sparsity or transform configs are not served")
    groups = []
    for group_name, group in (config.get("config_groups") or {}).items():
        if group.get("output_activations"):
            raise UnsupportedQuantization(f"compressed-tensors group {group_name!r}: output activation "
                                          "quantization is not served")
        fmt_of_group = group.get("format") or fmt
        groups.append((list(group.get("targets") or ["Linear"]), _compressed_tensors_scheme(group_name, group,
                                                                                          fmt_of_group)))
    if not groups:
        raise UnsupportedQuantization("a compressed-tensors config without config_groups")
    return groups, list(config.get("ignore") or [])


def _compressed_tensors_scheme(group_name: str, group: dict, fmt: str) -> Scheme:
    weights, acts = group.get("weights") or {}, group.get("input_activations")
    where = f"compressed-tensors group {group_name!r} ({fmt})"
    if weights.get("type", "int") != "int" or weights.get("num_bits") not in (4, 8):
        raise UnsupportedQuantization(f"{where}: {weights.get('type')} {weights.get('num_bits')}-bit weights are "
                                      "not served (served: int8, int4)")
    if weights.get("actorder") in ("group", "dynamic"):
        raise UnsupportedQuantization(f"{where}: act-order (actorder={weights['actorder']!r}) is not served")
    strategy, bits = weights.get("strategy"), weights["num_bits"]
    if strategy not in ("channel", "group", "tensor"):
        raise UnsupportedQuantization(f"{where}: {strategy!r} weight scales are not served")
    if bits == 8 and (strategy == "group" or not weights.get("symmetric", True)):
        raise UnsupportedQuantization(f"{where}: int8 weights with {strategy} scales or zero points are not served "
                                      "(served: symmetric, per channel or per tensor)")
    if bits == 4 and (fmt != "pack-quantized" or strategy == "tensor"):
        raise UnsupportedQuantization(f"{where}: int4 weights per tensor or outside pack-quantized are not served")
    act_quant = False
    if acts:
        if not (acts.get("type", "int") == "int" and acts.get("num_bits") == 8 and acts.get("dynamic") is True
                and acts.get("strategy") == "token" and acts.get("symmetric", True) and bits == 8):
            raise UnsupportedQuantization(
                f"{where}: input activations {acts.get('type')}{acts.get('num_bits')} {acts.get('strategy')} "
                f"(dynamic={acts.get('dynamic')}, symmetric={acts.get('symmetric')}) are not served (served: int8 "
                "weights with dynamic per-token symmetric int8 activations)")
        act_quant = True
    return Scheme("compressed-tensors", bits, weights.get("group_size") if strategy == "group" else None, act_quant,
                  bool(weights.get("symmetric", True)), fmt)


def _gptq_awq_scheme(method: str, config: dict) -> Scheme:
    bits, group = config.get("bits", config.get("w_bit")), config.get("group_size", config.get("q_group_size"))
    if bits != 4:
        raise UnsupportedQuantization(f"{method} with {bits}-bit weights is not served (served: 4-bit)")
    group = None if group in (None, -1) else int(group)
    if method == "gptq":
        if config.get("desc_act"):
            raise UnsupportedQuantization("gptq with act-order (desc_act=true) is not served")
        fmt = config.get("checkpoint_format") or "gptq"
        if fmt not in ("gptq", "gptq_v2"):
            raise UnsupportedQuantization(f"gptq checkpoint_format {fmt!r} is not served (served: gptq, gptq_v2)")
        return Scheme("gptq", 4, group, False, bool(config.get("sym", True)), fmt)
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm":
        raise UnsupportedQuantization(f"awq version {version!r} is not served (served: gemm)")
    if not config.get("zero_point", True):
        raise UnsupportedQuantization("awq without zero points (zero_point=false) is not served")
    return Scheme("awq", 4, group, False, False, version)


# --- building one linear from its tensors -----------------------------------------------------------------------

def build_linear(scheme: Scheme, tensors: dict[str, torch.Tensor], in_features: int, out_features: int,
                 dtype: torch.dtype, name: str) -> QuantizedLinear:
    """The quantized module for the linear `name` from its checkpoint tensors (by their names under it)."""
    bias = tensors.get("bias")
    if scheme.method == "compressed-tensors":
        module = _compressed_tensors_linear(scheme, tensors, out_features, in_features, bias, dtype, name)
    else:
        module = _gptq_awq_linear(scheme, tensors, out_features, in_features, bias, dtype, name)
    if (module.in_features, module.out_features) != (in_features, out_features):
        raise ValueError(f"{name}: the checkpoint's quantized weight is {module.out_features}x{module.in_features}, "
                         f"the model's linear {out_features}x{in_features}")
    return module


def _compressed_tensors_linear(scheme, tensors, n, k, bias, dtype, name) -> QuantizedLinear:
    if "weight_g_idx" in tensors:
        raise UnsupportedQuantization(f"{name}: act-order (a weight_g_idx tensor) is not served")
    scale = tensors["weight_scale"]
    if scheme.format != "pack-quantized":
        weight = tensors["weight"]
        return Int8Linear(weight.to(torch.int8), scale.float().expand(weight.shape[0], 1), bias, dtype,
                          scheme.act_quant)
    shape = tuple(int(v) for v in tensors["weight_shape"]) if "weight_shape" in tensors else (n, k)
    packed = tensors["weight_packed"].contiguous()
    if scheme.weight_bits == 8:  # four bytes an int32, each offset by 128
        q = (packed.view(torch.uint8)[:, :shape[1]].to(torch.int16) - 128).to(torch.int8)
        return Int8Linear(q, scale.float().expand(shape[0], 1), bias, dtype, scheme.act_quant)
    values = _nibbles(packed.view(torch.uint8))[:, :shape[1]]  # [n, k], stored with an offset of 8
    group = scheme.group_size or shape[1]
    zeros = None
    if not scheme.symmetric:
        zp = tensors["weight_zero_point"]  # [n / 8, groups] int32, packed along n
        zeros = _nibbles(zp.T.contiguous().view(torch.uint8))[:, :shape[0]].T  # [n, groups], offset by 8
    return Int4Linear(values, scale.float().reshape(shape[0], -1), zeros, group, bias, dtype)


def _gptq_awq_linear(scheme, tensors, n, k, bias, dtype, name) -> QuantizedLinear:
    qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"]
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    if scheme.method == "gptq":
        g_idx = tensors.get("g_idx")
        in_features = qweight.shape[0] * 8
        group = scheme.group_size or in_features
        if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(in_features) // group):
            raise UnsupportedQuantization(f"{name}: act-order (a permuted g_idx) is not served")
        values = ((qweight[:, None, :] >> shifts[None, :, None]) & 15).reshape(in_features, -1).T  # [n, k]
        zeros = ((qzeros[:, :, None] >> shifts) & 15).reshape(qzeros.shape[0], -1)  # [groups, n]
        if scheme.format == "gptq":
            zeros = zeros + 1  # v1 checkpoints store each zero point minus one
    else:
        inverse = torch.tensor([AWQ_ORDER.index(p) for p in range(8)])
        values = ((qweight[:, :, None] >> shifts) & 15)[:, :, inverse].reshape(qweight.shape[0], -1).T
        zeros = ((qzeros[:, :, None] >> shifts) & 15)[:, :, inverse].reshape(qzeros.shape[0], -1)
        group = scheme.group_size or values.shape[1]
    return Int4Linear(values.contiguous(), scales.float().T.contiguous(), zeros.T.contiguous(), group, bias, dtype)


def _nibbles(data: torch.Tensor) -> torch.Tensor:
    """[rows, bytes] uint8 -> [rows, 2 * bytes]: each byte's low nibble, then its high one."""
    return torch.stack([data & 15, data >> 4], -1).reshape(data.shape[0], -1)
