"""What the engine needs to know about an HF causal LM: cache shapes, layer devices, limits, EOS ids."""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass

import torch

from paged_hf.integrations import accelerate as accelerate_integration
from paged_hf.kernels.spec import AttentionSpec
from paged_hf.worker.probes.model_probe import probe_layers
from paged_hf.worker.hybrid.recurrent_state import StateLayer


@dataclass
class ModelInfo:
    num_layers: int  # cache layers (what the model's attention writes; usually its decoder layers)
    attention_layers: list[AttentionSpec]  # per cache layer: heads, K and V head_dim, device, window, score terms
    state_layers: list[StateLayer]  # a hybrid model's recurrent layers (their states per request); else []
    dtype: torch.dtype
    input_device: torch.device  # where input_ids go (where the embedding computes)
    logits_device: torch.device  # where the logits come out (where the LM head computes)
    vocab_size: int
    max_positions: int | None
    eos_token_ids: list[int]
    accepts_logits_to_keep: bool

    @property
    def is_hybrid(self) -> bool:
        return bool(self.state_layers)

    @property
    def num_kv_heads(self) -> list[int]:
        return [layer.num_kv_heads for layer in self.attention_layers]

    @property
    def head_dim(self) -> list[int]:
        """Of the keys, per layer (the values' may differ: `value_head_dim`)."""
        return [layer.head_dim for layer in self.attention_layers]

    @property
    def value_head_dim(self) -> list[int]:
        return [layer.value_head_dim for layer in self.attention_layers]

    @property
    def layer_devices(self) -> list[torch.device]:
        return [layer.device for layer in self.attention_layers]


def text_config(config):
    """Multimodal wrappers keep the LM's fields in a sub-config."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def inspect_model(model: torch.nn.Module) -> ModelInfo:
    config = text_config(model.config)
    embeddings = model.get_input_embeddings()
    output_embeddings = model.get_output_embeddings()
    input_device = accelerate_integration.module_device(model, embeddings)
    attention_layers, state_layers = probe_layers(model, config, input_device)
    return ModelInfo(
        num_layers=len(attention_layers),
        attention_layers=attention_layers,
        state_layers=state_layers,
        dtype=_weights_dtype(model, embeddings),
        input_device=input_device,
        logits_device=input_device if output_embeddings is None else
        accelerate_integration.module_device(model, output_embeddings),
        vocab_size=output_embeddings.weight.shape[0] if hasattr(output_embeddings, "weight") else config.vocab_size,
        max_positions=getattr(config, "max_position_embeddings", None),
        eos_token_ids=eos_token_ids(model),
        accepts_logits_to_keep="logits_to_keep" in inspect.signature(model.forward).parameters,
    )


def _weights_dtype(model: torch.nn.Module, embeddings: torch.nn.Module) -> torch.dtype:
    """The embeddings' dtype; a later pipeline stage (no embeddings) has its layers' floating dtype."""
    if hasattr(embeddings, "weight"):
        return embeddings.weight.dtype
    return model.dtype


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
