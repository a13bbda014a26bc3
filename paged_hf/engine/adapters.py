"""LoRA serving for the engine: the adapters of a wrapped PeftModel, and the manager made with the first adapter."""

from __future__ import annotations

import torch

from paged_hf.config.groups import LoRAConfig
from paged_hf.worker.model_info import ModelInfo
from paged_hf.worker.model_runner import ModelRunner


def split_peft_model(model: torch.nn.Module):
    """-> (the PeftModel or None, the model the engine runs): a PeftModel's adapters are served by name, and
    its base model (with peft's layers bypassed in every step) runs underneath."""
    if type(model).__module__.startswith("peft.") and hasattr(model, "get_base_model"):
        return model, model.get_base_model()
    return None, model


def adapter_slots(config: LoRAConfig, info: ModelInfo) -> int:
    """Distinct adapters one step can hold. On a GPU a slot is a copy of the adapter in device memory: `max_loras`
    of them. On a CPU the adapter's host copy is its slot (the kernel reads it in place, nothing is copied), so
    every adapter in host memory can be in a step: `max_cpu_loras` where that is larger."""
    if config.max_cpu_loras is not None and all(device.type == "cpu" for device in info.layer_devices):
        return max(config.max_loras, config.max_cpu_loras)
    return config.max_loras


def lora_manager(runner: ModelRunner, config: LoRAConfig):
    """The runner's LoRAManager, created with the first adapter (peft is imported only for LoRA); with no
    adapter loaded it only costs a check per step."""
    if runner.lora is None:
        from paged_hf.integrations.lora import LoRAManager  # noqa: PLC0415

        runner.lora = LoRAManager(runner.model, adapter_slots(config, runner.info), config.max_lora_rank)
    return runner.lora
