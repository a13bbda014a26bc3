"""Quantized checkpoint folders of tiny random Llama models, written in seconds on a CPU.

- compressed-tensors folders are written by the compressed-tensors library itself (`apply_quantization_config`,
  `ModelCompressor.compress_model`, `update_config`), with the min/max scales llm-compressor's QuantizationModifier
  computes without calibration data. llm-compressor itself cannot be installed beside this project
  (llmcompressor 0.14 pins transformers <= 5.17), so its observer's two lines are done here.
- GPTQ and AWQ folders are written by hand in their documented layouts (GPTQModel 7.7 needs torch >= 2.14.1,
  AutoAWQ a CUDA build): GPTQ qweight [in / 8, out] int32 (8 input rows a word, low nibble first), qzeros
  [groups, out / 8] (stored minus one in checkpoint_format "gptq", as they are in "gptq_v2"), scales
  [groups, out] fp16, g_idx; AWQ (version gemm) qweight [in, out / 8] and qzeros [groups, out / 8] with the 8
  columns of a word in AWQ's order 0, 2, 4, 6, 1, 3, 5, 7, scales [groups, out] fp16.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float32, tie: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=tie)
    model = LlamaForCausalLM(config).to(dtype).eval()
    with torch.no_grad():  # larger than the default init, so quantization moves the logits visibly
        for name, parameter in model.named_parameters():
            if name.endswith("proj.weight"):
                parameter.mul_(3)
    return model


def write_compressed_tensors(model, folder, preset: str, group_size: int | None = None,
                             strategy: str | None = None) -> Path:
    """`preset`: compressed-tensors' scheme name (W8A8, W4A16, W4A16_ASYM, W8A16), optionally with another group
    size or weight strategy."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = preset_name_to_scheme(preset, ["Linear"])
    if strategy is not None:
        scheme.weights.strategy, scheme.weights.group_size = strategy, None
    if group_size is not None:
        scheme.weights.group_size = group_size
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    for module in model.modules():
        found = getattr(module, "quantization_scheme", None)
        if found is None:
            continue
        weight, args = module.weight.data, found.weights
        if args.strategy == "group":  # llm-compressor's min/max observer, without calibration data
            view = weight.view(weight.shape[0], -1, args.group_size)
            low, high = view.amin(-1), view.amax(-1)
        else:
            low, high = weight.amin(-1, keepdim=True), weight.amax(-1, keepdim=True)
        scale, zero_point = calculate_qparams(low, high, args)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero_point.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(str(folder))
    return Path(folder)


def int4_groups(weight: torch.Tensor, group: int, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ's / AWQ's min-max 4-bit quantization of weight [out, in] by groups: (q [out, in], scales [out, groups],
    zeros [out, groups]), q and zeros in [0, 15], w ~ (q - z) * s."""
    n, k = weight.shape
    view = weight.float().view(n, k // group, group)
    low, high = view.amin(-1).clamp(max=0), view.amax(-1).clamp(min=0)
    if symmetric:
        high = torch.maximum(low.abs(), high)
        scale = (2 * high / 15).clamp(min=1e-8)
        zeros = torch.full_like(scale, 8.0)
    else:
        scale = ((high - low) / 15).clamp(min=1e-8)
        zeros = torch.round(-low / scale).clamp(0, 15)
    scale = scale.half().float()  # stored as fp16: quantize with the stored scale
    q = torch.clamp(torch.round(view / scale[:, :, None]) + zeros[:, :, None], 0, 15).view(n, k)
    return q.to(torch.int32), scale, zeros.to(torch.int32)


def _pack_rows(values: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """values [rows, 8 c] in [0, 15] -> [rows, c] int32: nibble i of word c holds column 8 c + order[i]."""
    rows, cols = values.shape
    grouped = values.view(rows, cols // 8, 8).to(torch.int64)
    word = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for i, column in enumerate(order):
        word |= grouped[:, :, column] << (4 * i)
    return (word - ((word >> 31) << 32)).to(torch.int32)  # the 32-bit pattern as a signed int32


def write_gptq_awq(model, folder, method: str, group: int, symmetric: bool = True, fmt: str = "gptq",
                   desc_act: bool = False) -> Path:
    folder = Path(folder)
    model.save_pretrained(folder)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if not k.endswith(tuple(f"{p}.weight"
                                                                                            for p in LINEARS))}
    for name, module in model.named_modules():
        if not name.endswith(LINEARS):
            continue
        q, scales, zeros = int4_groups(module.weight.data, group, symmetric and method == "gptq")
        if method == "gptq":
            state[f"{name}.qweight"] = _pack_rows(q.T.contiguous().view(-1, 8, q.shape[0]).transpose(1, 2)
                                                  .reshape(-1, 8)).view(-1, q.shape[0])
            stored = zeros.T - (1 if fmt == "gptq" else 0)
            state[f"{name}.qzeros"] = _pack_rows(stored)
            state[f"{name}.g_idx"] = (torch.arange(q.shape[1]) // group).to(torch.int32)
        else:
            state[f"{name}.qweight"] = _pack_rows(q.T.contiguous(), AWQ_ORDER)
            state[f"{name}.qzeros"] = _pack_rows(zeros.T.contiguous(), AWQ_ORDER)
        state[f"{name}.scales"] = scales.T.contiguous().half()
    for old in folder.glob("*.safetensors"):
        old.unlink()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    if method == "gptq":
        config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": symmetric,
                                         "desc_act": desc_act, "checkpoint_format": fmt}
    else:
        config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                         "version": "gemm"}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder
