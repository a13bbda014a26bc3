"""LoRA adapters on quantized base linears: the engine's per-token routing (kernels/lora.py) on top of the
quantized modules equals the reference (the base's torch reference plus x A^T B^T scaling per adapter), base-model
and adapter requests in one batch. peft itself cannot wrap a quantized linear that is not an nn.Linear, so the
reference adds the update with forward hooks."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import paged_hf
from paged_hf.integrations.peft import save_random_adapter
from paged_hf.kernels.quant_linear import QuantizedLinear
from paged_hf.loader.quantized import load_quantized_model, quantize_model
from tests.conftest import assert_no_leak, hf_greedy, random_prompts
from tests.loader.quant_folders import tiny_llama, write_gptq_awq


def _with_adapter_hooks(model, folder):
    """Forward hooks adding the adapter's update to each targeted module's output; returns their handles."""
    config = json.loads((folder / "adapter_config.json").read_text())
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    scaling = config["lora_alpha"] / config["r"]
    handles = []
    for name, module in model.named_modules():
        key = f"base_model.model.{name}.lora_A.weight"
        if key not in tensors:
            continue
        a, b = tensors[key].double(), tensors[key.replace("lora_A", "lora_B")].double()
        handles.append(module.register_forward_hook(
            lambda mod, args, out, a=a, b=b: out + ((args[0].double() @ a.T) @ b.T * scaling).to(out.dtype)))
    return handles


@pytest.mark.parametrize("base", ["int8", "gptq"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_lora_on_quantized_linears_equals_the_reference(tmp_path, base, dtype):
    """float64: the base linears one by one, HF on their torch references. float32: q/k/v and gate/up run as one
    stacked call in the engine with the adapters' updates on top (HF on the same kernels, one linear at a time)."""
    if base == "int8":
        model = tiny_llama(seed=5, dtype=dtype)
        quantize_model(model, "int8")
    else:
        model = load_quantized_model(write_gptq_awq(tiny_llama(seed=5), tmp_path / "gptq", "gptq", 32), dtype)
    model.generation_config.eos_token_id = None
    adapter = tmp_path / "adapter"
    save_random_adapter(model, adapter, seed=1, std=0.5, r=4, lora_alpha=8, target_modules="all-linear")
    prompts = random_prompts([7, 21, 12], seed=6)
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            module.use_kernel = dtype != torch.float64
    base_tokens = [hf_greedy(model, p, 10) for p in prompts]
    handles = _with_adapter_hooks(model, adapter)
    adapter_tokens = [hf_greedy(model, p, 10) for p in prompts]
    for handle in handles:
        handle.remove()
    assert adapter_tokens != base_tokens  # the adapter changes the outputs: the comparison below can fail
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            module.use_kernel = True
    generator = paged_hf.wrap(model, num_blocks=64, block_size=8, adapters={"a": str(adapter)}).generator
    params = paged_hf.SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
    outputs = generator.generate(prompts + prompts, params, adapters=["a"] * 3 + [None] * 3, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == adapter_tokens + base_tokens
    groups = generator.runner.fused_layers.groups  # float32: the stacks ran (built at the first step)
    assert len(groups) == (4 if dtype == torch.float32 else 0) and all(group.stack is not None for group in groups)
    assert_no_leak(generator)
