"""A pipeline stage of a model: which decoder layers it holds, and loading only those from a checkpoint.

Stage i of N holds layers [start, end) (the embeddings on the first stage, the final norm and the LM head on the
last); the modules another stage holds are `MissingModule`s, which pass their input through, so the model's own
forward runs unchanged on every stage (worker/pipeline.py links the stages). The model is built on the meta
device (no memory) and the stage's own tensors are read from the safetensors files one by one. Which modules exist and how they
connect comes from transformers' own `base_model_pp_plan` (embeddings -> layers -> norm); a model without one is
refused. A tied LM head on the last stage is read from the embeddings' tensor.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from paged_hf.loader.stage_shards import shard_stage, tensor_group


@dataclass(frozen=True)
class StageLayout:
    index: int  # this stage, 0 .. count - 1 (its rank in the pipeline's process group)
    count: int
    start: int  # its decoder layers are [start, end) of the model's
    end: int
    num_layers: int
    tp_rank: int = 0  # tensor parallelism inside the stage (loader/stage_shards.py): this rank of the stage's
    tp_size: int = 1

    @property
    def rank(self) -> int:
        """This process's rank in the pipeline's process group (stages outer, a stage's tensor ranks inner)."""
        return self.index * self.tp_size + self.tp_rank

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1

    def holds(self, layer: int) -> bool:
        return self.start <= layer < self.end


#: vLLM's VLLM_PP_LAYER_PARTITION under our name: the layers of each stage, e.g. "18,12"
PARTITION_ENV = "PAGED_HF_PP_LAYER_PARTITION"
#: the share of a step's rows the LM head computes (the sampled ones; about a quarter in the bench's mixed
#: workload: 6,838 of 25,187 tokens): what the last stage's head weighs in the default split
HEAD_ROW_SHARE = 0.25


def stage_layout(num_layers: int, index: int, count: int, head_layers: float = 0.0) -> StageLayout:
    """Stage `index`'s layers: as $PAGED_HF_PP_LAYER_PARTITION says, else split so that every stage does about the
    same work, the last stage's LM head counted as `head_layers` layers (its weights over a layer's, times the
    rows it computes: `HEAD_ROW_SHARE`); where layers do not divide, the first stages take one more each."""
    if not 1 <= count <= num_layers:
        raise ValueError(f"pipeline_parallel_size must be in [1, {num_layers}] (the model's layers), got {count}")
    if not 0 <= index < count:
        raise ValueError(f"pipeline stage {index} out of range for {count} stages")
    sizes = _partition(num_layers, count, head_layers)
    start = sum(sizes[:index])
    return StageLayout(index, count, start, start + sizes[index], num_layers)


def _partition(num_layers: int, count: int, head_layers: float) -> list[int]:
    text = os.environ.get(PARTITION_ENV, "").strip()
    if not text:
        if count == 1:
            return [num_layers]
        last = int((num_layers + head_layers) / count - head_layers + 1e-9)  # the last stage's share, floored
        last = min(max(1, last), num_layers - count + 1)
        size, extra = divmod(num_layers - last, count - 1)
        return [size + (i < extra) for i in range(count - 1)] + [last]
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        sizes = []
    if len(sizes) != count or min(sizes) < 1 or sum(sizes) != num_layers:
        raise ValueError(f"{PARTITION_ENV}={text!r}: give {count} layer counts >= 1 that add up to {num_layers}")
    return sizes


class MissingModule(torch.nn.Module):
    """A module another stage holds: its first input passes through (a decoder layer's hidden states, the
    final norm's, the LM head's). A missing decoder layer keeps the attributes the model's loop reads. Code that
    maps names to modules (LoRA weights) skips what lies under one (`is_pipeline_placeholder`)."""

    is_pipeline_placeholder = True

    def __init__(self, replaced: torch.nn.Module | None = None):
        super().__init__()
        for name in ("attention_type", "layer_idx"):
            if replaced is not None and hasattr(replaced, name):
                setattr(self, name, getattr(replaced, name))

    def forward(self, *args, **kwargs):
        return args[0] if args else next(iter(kwargs.values()))


def stage_of(model: torch.nn.Module) -> StageLayout | None:
    """The stage a model was loaded as (loader/pipeline_stage.py), None for a whole model."""
    return getattr(model, "pipeline_stage", None)


def absent_layers(model: torch.nn.Module) -> set[int]:
    """The decoder layers other stages hold (they write no K/V here)."""
    stage = stage_of(model)
    return set() if stage is None else {i for i in range(stage.num_layers) if not stage.holds(i)}


def load_stage(folder, dtype: torch.dtype, device, index: int, count: int, tp_size: int = 1) -> torch.nn.Module:
    """Stage `index` of `count` of the checkpoint in `folder`, in eval mode, with `model.pipeline_stage` set;
    `tp_size` > 1: this rank's slice of it (loader/stage_shards.py; the process group holds count * tp_size ranks,
    this one's tensor rank is its global rank's remainder)."""
    from accelerate import init_empty_weights  # noqa: PLC0415
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: PLC0415

    config = AutoConfig.from_pretrained(folder)
    text = config.get_text_config()
    if getattr(config, "quantization_config", None) is not None:
        raise ValueError(f"{folder}: a quantized checkpoint is not served pipeline-parallel")
    if not getattr(text, "base_model_pp_plan", None):
        raise ValueError(f"{type(config).__name__} cannot be served pipeline-parallel: transformers gives it no "
                         "base_model_pp_plan (how its layers split into stages)")
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    stage = stage_layout(text.num_hidden_layers, index, count, _head_layers(model))
    _drop_other_stages(model, stage)
    _read_tensors(model, Path(str(folder)), dtype, tied=bool(getattr(text, "tie_word_embeddings", False)))
    if tp_size > 1:
        stage = _split_tensors(model, stage, tp_size)
    model.pipeline_stage = stage
    if (Path(str(folder)) / "generation_config.json").exists():  # its EOS ids, as from_pretrained reads them
        from transformers import GenerationConfig  # noqa: PLC0415

        model.generation_config = GenerationConfig.from_pretrained(folder)
    model.to(device)
    return model.eval()


def _split_tensors(model: torch.nn.Module, stage: StageLayout, tp_size: int) -> StageLayout:
    """This rank's slice of the stage's linears; the layout with its tensor rank."""
    if not dist.is_initialized() or dist.get_world_size() != stage.count * tp_size:
        raise ValueError(f"{stage.count} pipeline stages of {tp_size} tensor-parallel ranks run in a process group "
                         f"of {stage.count * tp_size} ranks (torch.distributed, initialized before loading)")
    if dist.get_rank() // tp_size != stage.index:
        raise ValueError(f"rank {dist.get_rank()} belongs to pipeline stage {dist.get_rank() // tp_size}, "
                         f"not {stage.index} ({tp_size} tensor-parallel ranks a stage)")
    stage = dataclasses.replace(stage, tp_rank=dist.get_rank() % tp_size, tp_size=tp_size)
    shard_stage(model, stage.tp_rank, tp_size, tensor_group(stage.index, stage.count, tp_size))
    model._tp_size = tp_size  # what the adapters and quantization check: sharded linears
    return stage


def _head_layers(model: torch.nn.Module) -> float:
    """The LM head's work in decoder layers' (the default split gives the last stage that many fewer)."""
    head = getattr(model.get_output_embeddings(), "weight", None)
    layer = sum(p.numel() for p in model.get_decoder().layers[0].parameters())
    return 0.0 if head is None or not layer else head.numel() / layer * HEAD_ROW_SHARE


def _drop_other_stages(model: torch.nn.Module, stage: StageLayout) -> None:
    base = model.get_decoder()
    plan = type(model.config.get_text_config()).base_model_pp_plan
    layers = getattr(base, "layers")
    for i in range(stage.num_layers):
        if not stage.holds(i):
            layers[i] = MissingModule(layers[i])
    first_modules = [name for name in plan if name not in ("layers", "norm")]  # the embeddings
    if not stage.is_first:
        for name in first_modules:
            setattr(base, name, MissingModule())
    if not stage.is_last:
        if "norm" in plan:
            base.norm = MissingModule()
        model.set_output_embeddings(MissingModule())


def _read_tensors(model: torch.nn.Module, folder: Path, dtype: torch.dtype, tied: bool) -> None:
    """Every parameter and persistent buffer of the stage, from the files that hold them."""
    from safetensors import safe_open  # noqa: PLC0415

    wanted = set(model.state_dict())
    where = _checkpoint_keys(folder)
    embedding_key = next((k for k in where if k.endswith("embed_tokens.weight")), None)
    sources = {key: key for key in wanted if key in where}
    head = "lm_head.weight"
    if head in wanted and head not in where and tied and embedding_key is not None:
        sources[head] = embedding_key  # the tied head is the embeddings' tensor
    missing = sorted(wanted - set(sources))
    if missing:
        raise ValueError(f"{folder}: the checkpoint lacks {len(missing)} of this pipeline stage's tensors "
                         f"(renamed or fused in the checkpoint?): {missing[:5]}")
    tensors = {}
    by_file: dict[str, list[str]] = {}
    for key, source in sources.items():
        by_file.setdefault(where[source], []).append(key)
    for file, keys in by_file.items():
        with safe_open(str(folder / file), framework="pt") as handle:
            for key in keys:
                tensor = handle.get_tensor(sources[key])
                tensors[key] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    model.load_state_dict(tensors, strict=False, assign=True)
    meta = [name for name, p in model.named_parameters() if p.device.type == "meta"]
    if meta:
        raise ValueError(f"{folder}: this pipeline stage's tensors {meta[:5]} were not read")


def _checkpoint_keys(folder: Path) -> dict[str, str]:
    """Tensor name -> the safetensors file holding it."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return json.loads(index.read_text())["weight_map"]
    from safetensors import safe_open  # noqa: PLC0415

    keys = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            keys.update(dict.fromkeys(handle.keys(), file.name))
    if not keys:
        raise ValueError(f"{folder}: no .safetensors files (a pipeline stage is read from safetensors)")
    return keys
