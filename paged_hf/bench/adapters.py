"""Random LoRA adapters for `paged-hf bench --workload lora --adapters N`: N real peft folders, made once per model
and rank and kept in the cache folder, so a run needs no adapter of the user's and no hub.

The adapters are shaped from the model's config on the meta device (no weights are loaded in the bench's own
process): rank `rank` on every linear layer, alpha 2 * rank, seed i for adapter i.
"""

from __future__ import annotations

import re

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from paged_hf.integrations.peft import save_random_adapter
from paged_hf.loader.default_model import ensure_default_checkpoint, is_default_model
from paged_hf.utils import cache_root


def adapter_name(index: int) -> str:
    return f"lora_{index}"


def random_adapters(model: str | None, num_adapters: int, rank: int) -> dict[str, str]:
    """{name: folder} of `num_adapters` random rank-`rank` adapters for `model` (None: the default model)."""
    if num_adapters < 1 or rank < 1:
        raise ValueError(f"--adapters and --lora-rank must be >= 1, got {num_adapters} and {rank}")
    source = str(ensure_default_checkpoint()) if is_default_model(model) else model
    key = re.sub(r"[^A-Za-z0-9_.-]+", "_", "default" if is_default_model(model) else str(model)).strip("_")
    root = cache_root() / "bench_adapters" / f"{key}_r{rank}"
    folders = {adapter_name(i): root / adapter_name(i) for i in range(num_adapters)}
    missing = [i for i, folder in enumerate(folders.values()) if not (folder / "adapter_config.json").exists()]
    if missing:
        with torch.device("meta"):  # only the layers' shapes matter
            shapes = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source))
        for i in missing:
            save_random_adapter(shapes, folders[adapter_name(i)], seed=i, std=0.05, r=rank, lora_alpha=2 * rank,
                                target_modules="all-linear")
    return {name: str(folder) for name, folder in folders.items()}
