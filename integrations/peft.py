"""Reads peft LoRA adapter folders into plain tensors that the engine routes per token.

peft does the reading and the validation it knows (`PeftConfig.from_pretrained`, `LoraConfig`, its own
target-module matching, so `target_modules` lists, regexes, `all-linear`, `layers_to_transform`,
`exclude_modules`, `rank_pattern` and `alpha_pattern` mean exactly what they mean in peft). Its forward is
not used: peft routes mixed batches per row and loops over adapters, while a packed step needs per-token
routing (`paged_hf.integrations.lora`).

Anything that would make the served result differ from peft's is refused with a ValueError that names the
reason (DoRA, `modules_to_save`, biases, non-Linear targets, ranks above `max_lora_rank`, ...), before any
engine state changes: a broken adapter never half-loads.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

WEIGHTS_SAFETENSORS = "adapter_model.safetensors"
WEIGHTS_BIN = "adapter_model.bin"
CONFIG_NAME = "adapter_config.json"

# LoraConfig fields that change the forward beyond `B @ A`: refused rather than silently ignored
_UNSUPPORTED = {
    "use_dora": "DoRA (use_dora=True)",
    "modules_to_save": "modules_to_save (fully fine-tuned module copies)",
    "lora_bias": "lora_bias=True",
    "trainable_token_indices": "trainable_token_indices",
    "target_parameters": "target_parameters (LoRA on raw parameters)",
    "layer_replication": "layer_replication",
    "use_qalora": "QALoRA (use_qalora=True)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "fan_in_fan_out": "fan_in_fan_out=True (Conv1D weights)",
}
# a saved tensor name: [base_model.model.]<module path>.lora_A|lora_B[.<adapter name>].weight
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<path>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")


@dataclass(eq=False)
class LoRAAdapter:
    """One loaded adapter, held in CPU memory; copied into a device slot while requests use it.

    Compared by identity: a re-load under the same name is a new adapter (new `version`), so requests that
    started with the old weights keep them, and prefix-cache keys (which include the version) never mix them.
    """

    name: str
    version: int
    path: str
    # module path in the served model -> (A [r, in_features], B [out_features, r]); B has the scaling
    # (alpha / r, or alpha / sqrt(r) with rsLoRA) folded in, so the forward is x @ A.T @ B.T
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @property
    def max_rank(self) -> int:
        return max(a.shape[0] for a, _ in self.weights.values())


def read_adapter(name: str, path, model: torch.nn.Module, max_rank: int, version: int) -> LoRAAdapter:
    """Read and validate the peft LoRA folder `path` for `model`; ValueError (naming `name`) if unusable."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"adapter {name!r}: {str(path)!r} is not a folder")
    config = _read_config(name, folder)
    _check_config(name, config, max_rank)
    targets = _target_modules(name, config, model)
    tensors = _read_tensors(name, folder)
    weights = _match_weights(name, config, targets, tensors, max_rank)
    return LoRAAdapter(name, version, str(folder), weights)


def _read_config(name: str, folder: Path):
    from peft import LoraConfig, PeftConfig  # noqa: PLC0415

    if not (folder / CONFIG_NAME).is_file():
        raise ValueError(f"adapter {name!r}: {folder} has no {CONFIG_NAME}")
    try:
        config = PeftConfig.from_pretrained(str(folder))
    except Exception as exc:  # bad JSON, unknown fields, failed __post_init__ checks: all are the user's folder
        raise ValueError(f"adapter {name!r}: cannot read {folder / CONFIG_NAME}: {exc}") from exc
    if not isinstance(config, LoraConfig):
        raise ValueError(f"adapter {name!r}: {folder} is a {config.peft_type} adapter; only LoRA is supported")
    return config


def _check_config(name: str, config, max_rank: int) -> None:
    for attribute, what in _UNSUPPORTED.items():
        if getattr(config, attribute, None):
            raise ValueError(f"adapter {name!r} uses {what}, which paged_hf does not support")
    if config.bias != "none":
        raise ValueError(f"adapter {name!r} trains biases (bias={config.bias!r}), which paged_hf does not support")
    ranks = [config.r, *(config.rank_pattern or {}).values()]
    if max(ranks) > max_rank:
        raise ValueError(f"adapter {name!r} has rank {max(ranks)}, above max_lora_rank={max_rank}")


def _target_modules(name: str, config, model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """The modules the adapter applies to, matched by peft's own rules. Only nn.Linear, never the output
    layer (logits are computed for a few tokens only, so per-token routing does not line up there)."""
    from peft.tuners.tuners_utils import _maybe_include_all_linear_layers, check_target_module_exists  # noqa: PLC0415

    config = _maybe_include_all_linear_layers(config, model)  # expands "all-linear" (config is our own copy)
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    targets = {}
    for path, module in model.named_modules():
        if not path or not check_target_module_exists(config, path):
            continue
        if module is output:
            raise ValueError(f"adapter {name!r} targets the output layer {path!r}, which paged_hf does not support")
        if not isinstance(module, torch.nn.Linear):
            raise ValueError(f"adapter {name!r} targets {path!r}, a {type(module).__name__}: only nn.Linear "
                             "modules are supported")
        targets[path] = module
    if not targets:
        raise ValueError(f"adapter {name!r}: target modules {config.target_modules!r} not found in the model")
    return targets


def _read_tensors(name: str, folder: Path) -> dict[str, torch.Tensor]:
    """safetensors first; a `.bin` only through torch.load(weights_only=True) (no pickled code runs)."""
    try:
        if (folder / WEIGHTS_SAFETENSORS).is_file():
            from safetensors.torch import load_file  # noqa: PLC0415

            return load_file(str(folder / WEIGHTS_SAFETENSORS), device="cpu")
        if (folder / WEIGHTS_BIN).is_file():
            tensors = torch.load(folder / WEIGHTS_BIN, map_location="cpu", weights_only=True)
            if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
                raise ValueError("not a dict of tensors")
            return tensors
    except Exception as exc:
        raise ValueError(f"adapter {name!r}: cannot read the weights in {folder}: {exc}") from exc
    raise ValueError(f"adapter {name!r}: {folder} has neither {WEIGHTS_SAFETENSORS} nor {WEIGHTS_BIN}")


def _match_weights(name: str, config, targets: dict[str, torch.nn.Linear], tensors: dict[str, torch.Tensor],
                   max_rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Pair every target module with its A and B, check shapes, fold the scaling into B."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise ValueError(f"adapter {name!r}: unexpected tensor {key!r} (only lora_A/lora_B weights are supported)")
        if match["path"] not in targets:
            raise ValueError(f"adapter {name!r}: weights for {match['path']!r}, which is not a target module of "
                             "the model (target modules not found)")
        found.setdefault(match["path"], {})[match["ab"]] = tensor
    weights = {}
    for path, linear in targets.items():
        pair = found.get(path, {})
        if set(pair) != {"A", "B"}:
            raise ValueError(f"adapter {name!r}: missing lora_A/lora_B weights for {path!r}")
        a, b = pair["A"], pair["B"]  # [r, in_features], [out_features, r]
        rank = a.shape[0]
        if a.shape != (rank, linear.in_features) or b.shape != (linear.out_features, rank):
            raise ValueError(f"adapter {name!r}: {path!r} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
                             f"which do not fit a Linear({linear.in_features}, {linear.out_features})")
        if rank > max_rank:
            raise ValueError(f"adapter {name!r} has rank {rank} at {path!r}, above max_lora_rank={max_rank}")
        scaling = _scaling(config, path, rank)
        dtype = linear.weight.dtype
        weights[path] = (a.to(dtype).contiguous(), (b.double() * scaling).to(dtype).contiguous())
    return weights


def _scaling(config, path: str, rank: int) -> float:
    """peft's LoRA scaling for one module: alpha / r, or alpha / sqrt(r) with rsLoRA (patterns applied)."""
    from peft.utils.other import get_pattern_key  # noqa: PLC0415

    alpha_pattern = config.alpha_pattern or {}
    alpha = alpha_pattern.get(get_pattern_key(alpha_pattern.keys(), path), config.lora_alpha)
    return alpha / math.sqrt(rank) if config.use_rslora else alpha / rank
