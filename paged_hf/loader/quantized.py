"""Quantized models: a quantized checkpoint folder loaded onto its own integers, and a float model's linears
quantized at load (`quantization="int8"`).

A folder whose config.json has a `quantization_config` is built from its config without that entry (no weights
initialized), each linear the config quantizes replaced by its quantized module made from the folder's tensors
(quant_formats.py), and every other tensor loaded as usual (embeddings, norms, an unquantized lm_head). Nothing is
decompressed to a dense float weight: the engine then sees a model whose linears are quantized modules, applied
"from the outside" before it is wrapped, as gpt-fast applies its quantization. transformers' own quantizers are
not involved (they would decompress on every forward, or need a GPU).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers.utils import logging

from paged_hf.config.engine import QUANTIZATION_NAMES
from paged_hf.kernels import q4_panels
from paged_hf.kernels.quant_linear import (
    Int4Linear,
    Int8Linear,
    QuantizedLinear,
    quantize_int4_groups,
    quantize_int8_per_channel,
)
from paged_hf.loader.gptq import gptq_quantize
from paged_hf.loader.mapped_weights import copy_out_of_files
from paged_hf.loader.quant_formats import QuantizationConfig, UnsupportedQuantization, build_linear
from paged_hf.loader.smoothing import input_maxima, smoothing_scale

logger = logging.get_logger(__name__)

#: the group size of `quantization="w4a16"` and `"w4a16_gptq"` (4-bit weights with zero points; the names a float
#: model's `quantization=` accepts are config.engine.QUANTIZATION_NAMES)
W4A16_GROUP = 64


def quantization_config(folder) -> dict | None:
    """The `quantization_config` of a local checkpoint folder's config.json, or None."""
    path = Path(str(folder)) / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    found = config.get("quantization_config")
    return found if isinstance(found, dict) else None


def load_quantized_model(folder, dtype: torch.dtype, device="cpu"):
    """The model of a quantized checkpoint folder, its quantized linears on the folder's integers. Raises
    UnsupportedQuantization (a ValueError) naming the scheme when the folder is not served."""
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: PLC0415
    from transformers.initialization import no_init_weights  # noqa: PLC0415

    spec = QuantizationConfig(quantization_config(folder) or {})
    config = AutoConfig.from_pretrained(folder)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensors = read_tensors(folder)
    quantized = _replace_linears(model, spec, tensors, dtype)
    _load_the_rest(model, tensors, quantized)
    model.to(device)
    model.eval()
    logger.info(f"paged_hf: {len(quantized)} linears of {folder} served quantized ({spec.method}, {spec.describe()})")
    return model


def read_tensors(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file  # noqa: PLC0415

    files = sorted(Path(str(folder)).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder}: no .safetensors files (a quantized checkpoint is read from safetensors)")
    tensors = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return tensors


def _replace_linears(model: torch.nn.Module, spec: QuantizationConfig, tensors: dict, dtype: torch.dtype) -> set[str]:
    """Every linear the config quantizes, replaced by its quantized module; their names."""
    quantized_names = {key.rsplit(".", 1)[0] for key in tensors
                       if key.endswith((".weight_scale", ".weight_packed", ".qweight"))}
    replaced = set()
    for name, module in list(model.named_modules()):
        scheme = spec.scheme_of(name, module) if isinstance(module, torch.nn.Linear) else None
        if name not in quantized_names:  # left as it is (the lm_head, an ignored module)
            continue
        if not isinstance(module, torch.nn.Linear) or scheme is None:
            raise UnsupportedQuantization(f"{name}: quantized tensors for a {type(module).__name__} that the "
                                          f"{spec.method} config does not quantize as a Linear (not served)")
        prefix = name + "."
        own = {key[len(prefix):]: value for key, value in tensors.items() if key.startswith(prefix)}
        _swap(model, name, build_linear(scheme, own, module.in_features, module.out_features, dtype, name))
        replaced.add(name)
    missing = quantized_names - replaced
    if missing:
        raise UnsupportedQuantization(f"quantized tensors for modules this model has no Linear at: {sorted(missing)[:5]}"
                                      " (fused or renamed layers are not served quantized)")
    return replaced


def _load_the_rest(model: torch.nn.Module, tensors: dict, quantized: set[str]) -> None:
    rest = {key: value for key, value in tensors.items() if key.rsplit(".", 1)[0] not in quantized}
    result = model.load_state_dict(rest, strict=False)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    missing = [key for key in result.missing_keys if key.rsplit(".", 1)[0] not in quantized and key not in tied]
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} of the model's tensors: {missing[:5]}")
    if result.unexpected_keys:
        logger.warning(f"paged_hf: {len(result.unexpected_keys)} checkpoint tensors unused: "
                       f"{result.unexpected_keys[:5]}")


def _swap(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent_name, _, attribute = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attribute, module)


def quantize_model(model: torch.nn.Module, quantization: str) -> int:
    """Quantize the float model's linears in place: "int8" symmetric per output channel, round to nearest, W8A8
    with dynamic per-token activations, smoothed (SmoothQuant, loader/smoothing.py); "w4a16" 4-bit in groups of 64
    with zero points (min/max), round to nearest; "w4a16_gptq" the same grid, the values by GPTQ (loader/gptq.py);
    "w4a8" w4a16's weights repacked in panels, the activations int8 per block of 32 (kernels/q4_panels.py; a linear
    whose output size is not a multiple of 16 keeps W4A16). A linear whose input size is not a multiple of 64 takes
    int8 weights (W8A16) instead. The output layer (lm_head) and the embeddings stay as they are, but for "w4a8",
    whose output layer is W8A8 (`_quantize_head`). Returns how many linears were quantized. A model already
    quantized keeps its quantized modules."""
    if quantization not in QUANTIZATION_NAMES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_NAMES)}, got {quantization!r}")
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if (getattr(model, "tp_size", None) or 1) > 1:
        raise ValueError("quantization='int8' is not supported on a tensor-parallel model")
    linears = {name: module for name, module in model.named_modules()
               if type(module) is torch.nn.Linear and module is not output and module.weight.device.type != "meta"}
    maxima, groups = input_maxima(model, linears) if quantization == "int8" and linears else ({}, [])
    smoothing = {}  # linears reading one input share one scale
    for group in groups:
        shared = smoothing_scale(maxima[group[0]], [linears[name].weight for name in group])
        smoothing.update(dict.fromkeys(group, shared))
    gptq = {}  # name -> (values, scales, zeros), all computed on the float model before any linear is swapped
    if quantization == "w4a16_gptq" and linears:
        gptq = gptq_quantize(model, {name: module for name, module in linears.items()
                                     if module.in_features % W4A16_GROUP == 0}, W4A16_GROUP)
    for name, module in linears.items():
        swapped = _quantized(module, quantization, smoothing.get(name), gptq.get(name))
        _swap(model, name, swapped.to(module.weight.device))
    count = len(linears) + (quantization == "w4a8" and _quantize_head(model, output))
    if count:
        copy_out_of_files(model)  # what stays of a checkpoint's mapping lets go of it, and of the pages read here
    if count == 0 and not any(isinstance(m, QuantizedLinear) for m in model.modules()):
        raise ValueError(f"quantization={quantization!r}: the model has no plain nn.Linear layers to quantize")
    return count


def _quantize_head(model: torch.nn.Module, output: torch.nn.Module | None) -> bool:
    """W4A8's output layer: W8A8 per channel (as llama.cpp's Q4_0 keeps its output at 6-8 bits, not 4), a module of
    its own beside the embeddings it may be tied to (they stay as they are). Whether it was quantized."""
    if type(output) is not torch.nn.Linear or output.weight.device.type != "cpu":
        return False
    name = next(name for name, module in model.named_modules() if module is output)
    q, scale = quantize_int8_per_channel(output.weight)
    _swap(model, name, Int8Linear(q, scale, output.bias, output.weight.dtype, act_quant=True))
    return True


def _quantized(linear: torch.nn.Linear, quantization: str, smooth: torch.Tensor | None = None,
               int4: tuple | None = None) -> QuantizedLinear:
    """`smooth`: SmoothQuant's s [in] (W8A8, loader/smoothing.py): the weight is quantized as W * s, the input
    multiplied by 1 / s. `int4`: the 4-bit (values, scales, zeros) already chosen (GPTQ); None: round to nearest."""
    if quantization == "int8" or linear.in_features % W4A16_GROUP:
        weight = linear.weight if smooth is None else linear.weight.float() * smooth.to(linear.weight.device)
        q, scale = quantize_int8_per_channel(weight)
        return Int8Linear(q, scale, linear.bias, linear.weight.dtype, act_quant=quantization == "int8",
                          input_scale=None if smooth is None else 1 / smooth)
    values, scales, zeros = int4 if int4 is not None else quantize_int4_groups(linear.weight, W4A16_GROUP)
    act_quant = quantization == "w4a8" and q4_panels.fits(linear.out_features, linear.in_features, W4A16_GROUP)
    return Int4Linear(values, scales, zeros, W4A16_GROUP, linear.bias, linear.weight.dtype, act_quant=act_quant)


def describe_linears(model: torch.nn.Module) -> str:
    """What the model's linears compute with, e.g. "w8a8 x210, float x1" (banners, eval-ppl, bench)."""
    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            counts[module.scheme] = counts.get(module.scheme, 0) + 1
        elif isinstance(module, torch.nn.Linear):
            counts["float"] = counts.get("float", 0) + 1
    return ", ".join(f"{name} x{count}" for name, count in sorted(counts.items()))
