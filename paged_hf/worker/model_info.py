"""What the engine needs to know about an HF causal LM: cache shapes, layer devices, limits, EOS ids."""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass

import torch

from paged_hf.integrations import accelerate as accelerate_integration


@dataclass
class ModelInfo:
    num_layers: int
    num_kv_heads: list[int]  # per layer
    head_dim: list[int]  # per layer
    dtype: torch.dtype
    layer_devices: list[torch.device]
    input_device: torch.device  # where input_ids go (where the embedding computes)
    logits_device: torch.device  # where the logits come out (where the LM head computes)
    vocab_size: int
    max_positions: int | None
    eos_token_ids: list[int]
    accepts_logits_to_keep: bool


def text_config(config):
    """Multimodal wrappers keep the LM's fields in a sub-config."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def inspect_model(model: torch.nn.Module) -> ModelInfo:
    config = text_config(model.config)
    num_layers = config.num_hidden_layers
    embeddings = model.get_input_embeddings()
    output_embeddings = model.get_output_embeddings()
    input_device = accelerate_integration.module_device(model, embeddings)
    num_kv_heads, head_dim = _probe_kv_shapes(model, input_device)
    layer_devices = accelerate_integration.layer_devices(model, num_layers)
    return ModelInfo(
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=embeddings.weight.dtype,
        layer_devices=layer_devices,
        input_device=input_device,
        logits_device=input_device if output_embeddings is None else
        accelerate_integration.module_device(model, output_embeddings),
        vocab_size=output_embeddings.weight.shape[0] if output_embeddings is not None else config.vocab_size,
        max_positions=getattr(config, "max_position_embeddings", None),
        eos_token_ids=eos_token_ids(model),
        accepts_logits_to_keep="logits_to_keep" in inspect.signature(model.forward).parameters,
    )


@torch.inference_mode()
def _probe_kv_shapes(model: torch.nn.Module, device: torch.device) -> tuple[list[int], list[int]]:
    """Each layer's (num_kv_heads, head_dim), read off a one-token forward: configs name these fields in
    many ways (and a tensor-parallel shard holds only some heads), the cached keys never lie."""
    output = model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=True)
    cache = output["cache"] if "cache" in output else output["past_key_values"]  # transformers >= 5.x renamed it
    shapes = [layer.keys.shape for layer in cache.layers]  # [1, num_kv_heads, 1, head_dim]
    return [s[1] for s in shapes], [s[-1] for s in shapes]


def eos_token_ids(model) -> list[int]:
    generation_config = getattr(model, "generation_config", None)
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(text_config(model.config), "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
