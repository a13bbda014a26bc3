"""accelerate device maps: each layer's KV blocks live where that layer runs.

With `device_map=...` a layer's weights may sit on a GPU, on the CPU, or be offloaded (meta tensors that
accelerate's hook loads for each forward, onto the hook's `execution_device`). The cache follows the
device the layer *computes* on (where its K/V arrive: worker/probes/model_probe.py records it); block ids are shared
by all devices, so one block table serves every layer.
"""

from __future__ import annotations

import torch


def module_device(model: torch.nn.Module, module: torch.nn.Module) -> torch.device:
    """Where `module` (the embedding, the LM head) computes: its accelerate hook's execution device (an
    offloaded module's weights sit on meta), else the device of its weights, else the model's."""
    modules = dict(model.named_modules())
    name = next((n for n, m in modules.items() if m is module), None)
    device = execution_device(modules, name) if name is not None else None
    if device is not None:
        return device
    param = next((p for p in module.parameters() if p.device.type != "meta"), None)
    if param is not None:
        return param.device
    return execution_device(modules, "") or next(p.device for p in model.parameters())


def execution_device(modules: dict[str, torch.nn.Module], name: str) -> torch.device | None:
    """The execution device of the nearest accelerate hook on `name` or its parents, if any."""
    parts = name.split(".") if name else []
    for depth in range(len(parts), -1, -1):
        hook = getattr(modules.get(".".join(parts[:depth])), "_hf_hook", None)
        device = getattr(hook, "execution_device", None)
        if device is not None:
            return torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    return None
