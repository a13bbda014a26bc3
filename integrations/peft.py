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

import copy
import hashlib
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from paged_hf.kernels.quant_linear import QuantizedLinear, linear_dtype

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
    """One loaded adapter, held in CPU memory, in the served model's dtype; read in place while requests use it
    (a CPU model), or copied into a device slot (a GPU).

    Compared by identity: a re-load under the same name is a new adapter (new `version`), so requests that
    started with the old weights keep them, and prefix-cache keys (which include the version) never mix them.
    """

    name: str
    version: int
    path: str
    # module path in the served model -> (A [r, in_features], Bt [r, out_features]), both contiguous; Bt is B
    # transposed, with the scaling (alpha / r, or alpha / sqrt(r) with rsLoRA) folded in: the update is x @ A.T @ Bt
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    content_hash: str | None = None  # of the folder's config and weights files (None: read from a PeftModel)

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())

    @property
    def max_rank(self) -> int:
        return max(a.shape[0] for a, _ in self.weights.values())


@dataclass(eq=False)
class AdapterFiles:
    """A peft LoRA folder as read from disk, before it is matched to a model."""

    name: str
    path: str
    config: object = field(repr=False)  # its LoraConfig
    tensors: dict[str, torch.Tensor] = field(repr=False)
    content_hash: str = ""  # sha256 of the config and weights files: what prefix-cache keys hold, not the name


def read_adapter(name: str, path, model: torch.nn.Module, max_rank: int, version: int) -> LoRAAdapter:
    """Read and validate the peft LoRA folder `path` for `model`; ValueError (naming `name`) if unusable."""
    return build_adapter(read_adapter_files(name, path, max_rank), model, max_rank, version)


def read_adapter_files(name: str, path, max_rank: int) -> AdapterFiles:
    """The disk half of `read_adapter`: reads and checks what needs no model, so it may run on any thread
    (the model's modules are swapped during a step; `build_adapter` reads them on the engine thread)."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"adapter {name!r}: {str(path)!r} is not a folder")
    config = _read_config(name, folder)
    _check_config(name, config, max_rank)
    tensors = _read_tensors(name, folder)
    return AdapterFiles(name, str(folder), config, tensors, _content_hash(folder))


def build_adapter(files: AdapterFiles, model: torch.nn.Module, max_rank: int, version: int) -> LoRAAdapter:
    """Match the files to `model`'s modules; ValueError (naming the adapter) if they do not fit."""
    targets = _target_modules(files.name, files.config, model)
    weights = _match_weights(files.name, files.config, targets, _held_here(files.tensors, model), max_rank)
    return LoRAAdapter(files.name, version, files.path, weights, files.content_hash)


def _held_here(tensors: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors of modules this model holds: a pipeline stage leaves other stages' layers to them (their
    placeholders say `is_pipeline_placeholder`)."""
    absent = tuple(path + "." for path, module in model.named_modules()
                   if getattr(module, "is_pipeline_placeholder", False))
    if not absent:
        return tensors
    return {key: tensor for key, tensor in tensors.items()
            if not ((match := _KEY.match(key)) and (match["path"] + ".").startswith(absent))}


def folder_inside(root, path) -> str | None:
    """The real path of `path` (relative to `root`, or absolute) if it is a folder inside `root` once every `..`
    and symlink is resolved, else None: where a server may read adapters from."""
    root_real = os.path.realpath(root)
    target = os.path.realpath(os.path.join(root_real, path))
    if os.path.commonpath([root_real, target]) != root_real or target == root_real or not os.path.isdir(target):
        return None
    return target


def adapter_folder_under(root, name: str) -> str | None:
    """The peft folder that `name` means under a LoRA root (`root/name`, inside it, with an adapter config)."""
    if not isinstance(name, str) or not name or "\0" in name or os.path.isabs(name):
        return None
    folder = folder_inside(root, name)
    return folder if folder is not None and os.path.isfile(os.path.join(folder, CONFIG_NAME)) else None


def _content_hash(folder: Path) -> str:
    digest = hashlib.sha256()
    for file_name in (CONFIG_NAME, WEIGHTS_SAFETENSORS, WEIGHTS_BIN):
        if (folder / file_name).is_file():
            digest.update(file_name.encode() + b"\0" + (folder / file_name).read_bytes())
    return digest.hexdigest()


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


def linear_modules(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """Every nn.Linear of the model by path. A peft LoRA layer (a PeftModel being served) stands for its base
    Linear under its own path; the Linears inside it (base_layer, lora_A, lora_B) are not listed."""
    found: dict[str, torch.nn.Linear] = {}
    inside: tuple[str, ...] = ()
    for path, module in model.named_modules():
        if inside and path.startswith(inside):
            continue
        if is_peft_lora_layer(module):
            found[path] = module.base_layer
            inside += (path + ".",)
        elif isinstance(module, (torch.nn.Linear, QuantizedLinear)):  # a quantized base linear takes LoRA too
            found[path] = module
    return found


def is_peft_lora_layer(module: torch.nn.Module) -> bool:
    return isinstance(getattr(module, "base_layer", None), torch.nn.Linear) and hasattr(module, "lora_A")


def _target_modules(name: str, config, model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """The modules the adapter applies to, matched by peft's own rules. Only nn.Linear, never the output
    layer (logits are computed for a few tokens only, so per-token routing does not line up there)."""
    from peft.tuners.tuners_utils import check_target_module_exists  # noqa: PLC0415

    linears = linear_modules(model)
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(config.target_modules, str) and config.target_modules.lower() == "all-linear":
        # peft's meaning: every Linear but the output layer (config is our own copy, read from the folder)
        config.target_modules = {path for path, linear in linears.items() if linear is not output}
    targets = {}
    inside: tuple[str, ...] = tuple(path + "." for path in linears)
    for path, module in model.named_modules():
        if not path or path.startswith(inside) or not check_target_module_exists(config, path):
            continue
        if path not in linears:
            raise ValueError(f"adapter {name!r} targets {path!r}, a {type(module).__name__}: only nn.Linear "
                             "modules are supported")
        if linears[path] is output:
            raise ValueError(f"adapter {name!r} targets the output layer {path!r}, which paged_hf does not support")
        targets[path] = linears[path]
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
        dtype = linear_dtype(linear)
        weights[path] = (a.to(dtype).contiguous(), (b.double() * scaling).to(dtype).T.contiguous())
    return weights


def _scaling(config, path: str, rank: int) -> float:
    """peft's LoRA scaling for one module: alpha / r, or alpha / sqrt(r) with rsLoRA (patterns applied)."""
    from peft.utils.other import get_pattern_key  # noqa: PLC0415

    alpha_pattern = config.alpha_pattern or {}
    alpha = alpha_pattern.get(get_pattern_key(alpha_pattern.keys(), path), config.lora_alpha)
    return alpha / math.sqrt(rank) if config.use_rslora else alpha / rank


def adapters_from_peft_model(peft_model, max_rank: int, first_version: int) -> list[LoRAAdapter]:
    """The LoRA adapters already loaded in a PeftModel, read from its layers (peft's own scaling), so that a
    PeftModel is served by name: its base model runs underneath and its LoRA layers are bypassed in a step."""
    from peft import LoraConfig  # noqa: PLC0415

    model = peft_model.get_base_model()
    layers = {}
    for path, module in model.named_modules():
        if is_peft_lora_layer(module):
            if module.merged_adapters:
                raise ValueError(f"the PeftModel has adapters {module.merged_adapters} merged into {path!r}: "
                                 "unmerge them (peft_model.unmerge_adapter()) before serving")
            layers[path] = module
        elif hasattr(module, "lora_A") or hasattr(module, "lora_embedding_A"):
            raise ValueError(f"the PeftModel has a LoRA layer on {path!r}, a {type(module).__name__}: only "
                             "nn.Linear modules are supported")
    adapters = []
    for name, config in peft_model.peft_config.items():
        if not isinstance(config, LoraConfig):
            raise ValueError(f"adapter {name!r} of the PeftModel is a {config.peft_type} adapter; only LoRA is "
                             "supported")
        _check_config(name, config, max_rank)
        weights = {}
        for path, layer in layers.items():
            if name in layer.lora_A:
                a, b = layer.lora_A[name].weight.detach(), layer.lora_B[name].weight.detach()  # [r, in], [out, r]
                if a.shape[0] > max_rank:
                    raise ValueError(f"adapter {name!r} has rank {a.shape[0]} at {path!r}, above "
                                     f"max_lora_rank={max_rank}")
                dtype = layer.base_layer.weight.dtype
                weights[path] = (a.to("cpu", dtype).clone(),
                                 (b.double() * layer.scaling[name]).to("cpu", dtype).T.contiguous())
        if not weights:
            raise ValueError(f"adapter {name!r} of the PeftModel has no LoRA weights on Linear layers")
        adapters.append(LoRAAdapter(name, first_version + len(adapters), f"<PeftModel adapter {name}>", weights))
    return adapters


def save_random_adapter(model: torch.nn.Module, folder, seed: int = 0, std: float = 0.02, **lora_config) -> str:
    """Write a peft LoRA folder for `model` with random A and B (a fresh peft adapter has B = 0, so no effect)
    without copying the model: for examples, tests and benchmarks on machines without hub access.
    `lora_config`: LoraConfig fields (r, lora_alpha, target_modules, use_rslora, ...)."""
    from peft import LoraConfig  # noqa: PLC0415
    from safetensors.torch import save_file  # noqa: PLC0415

    config = LoraConfig(**lora_config)
    targets = _target_modules("random", copy.deepcopy(config), model)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for path, linear in targets.items():
        a = torch.randn(config.r, linear.in_features, generator=generator) / math.sqrt(linear.in_features)
        b = torch.randn(linear.out_features, config.r, generator=generator) * std
        tensors[f"base_model.model.{path}.lora_A.weight"] = a.to(linear_dtype(linear))
        tensors[f"base_model.model.{path}.lora_B.weight"] = b.to(linear_dtype(linear))
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(folder))
    save_file(tensors, str(folder / WEIGHTS_SAFETENSORS))
    return str(folder)
