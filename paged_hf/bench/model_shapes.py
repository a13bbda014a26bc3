"""`paged-hf bench --model-shape NAME`: a model of a published architecture with random weights, so the bench
covers the regime where decode reads gigabytes of weights per step, on a machine with no model hub.

Each shape copies the numbers of a published config.json (the table below names it): hidden size, layers,
heads, KV heads, intermediate size, head dim, RoPE, RMSNorm epsilon, tied embeddings. Two things differ from
the published model, on purpose:

- the weights are random (seeded, std 0.02: HF's own init, so generation stays finite in bfloat16);
- the tokenizer is the default model's (SmolLM2's, :mod:`paged_hf.loader.default_model`), and ``vocab_size`` is
  its length (49152), so the embedding and LM head are smaller than the published ones (``published_vocab_size``
  says by how much): a Llama-3.2-1B shape has 1.07B parameters here, not 1.24B.

The folder is a plain HF checkpoint (safetensors, config.json in the requested dtype, tokenizer files), built
once per shape and dtype under ``cache_root()/bench_models`` and reused, so every system of the bench (paged_hf,
the HF baselines, vLLM) and ``paged-hf serve --model FOLDER`` load the same thing.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

from paged_hf.loader.default_model import ensure_default_checkpoint
from paged_hf.utils import cache_root

#: written last into a built folder: its presence means the folder is complete (and says what it holds)
MARKER = "paged_hf_model_shape.json"
#: bump when the build changes, so that old folders are rebuilt
BUILD_VERSION = 1
_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class PublishedShape:
    """The architecture numbers of one published checkpoint, as its config.json gives them."""

    name: str
    source: str  # the config.json the numbers are copied from
    model_type: str  # transformers' model_type: "llama", "qwen2" or "qwen3_5_text"
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    head_dim: int
    rope_theta: float
    tie_word_embeddings: bool
    published_vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_scaling: dict = field(default_factory=dict)  # rope_type and its parameters beyond rope_theta
    extra: dict = field(default_factory=dict)  # fields of its own model_type (a hybrid's linear-attention layers)


MODEL_SHAPES: dict[str, PublishedShape] = {shape.name: shape for shape in [
    PublishedShape("smollm2-135m", "https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct/blob/main/config.json",
                   "llama", hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                   intermediate_size=1536, head_dim=64, rope_theta=100000.0, tie_word_embeddings=True,
                   published_vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5),
    PublishedShape("qwen2.5-0.5b", "https://huggingface.co/Qwen/Qwen2.5-0.5B/blob/main/config.json",
                   "qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                   intermediate_size=4864, head_dim=64, rope_theta=1000000.0, tie_word_embeddings=True,
                   published_vocab_size=151936, max_position_embeddings=32768, rms_norm_eps=1e-6),
    PublishedShape("llama-1b", "https://huggingface.co/meta-llama/Llama-3.2-1B/blob/main/config.json",
                   "llama", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                   intermediate_size=8192, head_dim=64, rope_theta=500000.0, tie_word_embeddings=True,
                   published_vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
                   rope_scaling=_LLAMA3_ROPE),
    PublishedShape("llama-3.2-3b", "https://huggingface.co/meta-llama/Llama-3.2-3B/blob/main/config.json",
                   "llama", hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
                   intermediate_size=8192, head_dim=128, rope_theta=500000.0, tie_word_embeddings=True,
                   published_vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
                   rope_scaling=_LLAMA3_ROPE),
    # Qwen3.5-0.8B's text model: a hybrid of Gated DeltaNet layers and gated full attention every 4th layer (6 of
    # 24 layers hold K/V). The published numbers known here (fitmygpu's model notes of Qwen/Qwen3.5-0.8B: 24 layers,
    # hidden 1024, 8 heads, 2 KV heads, 6 KV-bearing layers, vocab 248,320) and the Qwen3.5 family's conventions
    # for the rest (head_dim 256, linear attention 16 key and 16 value heads of 128, conv kernel 4, MLP 3584,
    # partial rotary 0.25): a shape of the same regime, not a copy of the checkpoint.
    PublishedShape("qwen3.5-0.8b", "https://huggingface.co/Qwen/Qwen3.5-0.8B (text model; linear-attention sizes "
                   "from the Qwen3.5 family)", "qwen3_5_text", hidden_size=1024, num_hidden_layers=24,
                   num_attention_heads=8, num_key_value_heads=2, intermediate_size=3584, head_dim=256,
                   rope_theta=10000000.0, tie_word_embeddings=True, published_vocab_size=248320,
                   max_position_embeddings=262144, rms_norm_eps=1e-6,
                   rope_scaling={"partial_rotary_factor": 0.25},
                   extra={"linear_num_key_heads": 16, "linear_num_value_heads": 16, "linear_key_head_dim": 128,
                          "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4}),
]}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM"}
#: the longest context a shape's folder is served with: the default tokenizer's (and default model's) 8192, since
#: the published 131072 would make `vllm serve` reserve KV for one such sequence before it starts
SERVING_MAX_LEN = 8192


def model_shape_names() -> list[str]:
    return list(MODEL_SHAPES)


def published_shape(name: str) -> PublishedShape:
    if name not in MODEL_SHAPES:
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(MODEL_SHAPES)}")
    return MODEL_SHAPES[name]


def shape_config(name: str, tokenizer, dtype: str = "float32") -> PretrainedConfig:
    """The HF config of shape `name` for `tokenizer` (its length is the vocab size) in `dtype`: no weights made."""
    shape = published_shape(name)
    extra = dict(shape.extra)
    if shape.model_type == "qwen2":  # every layer full attention, as the published config (use_sliding_window false)
        extra = {"use_sliding_window": False, "max_window_layers": shape.num_hidden_layers}
    if shape.model_type == "qwen3_5_text":  # its layer pattern, and partial rotary inside rope_parameters
        interval = extra.pop("full_attention_interval")
        extra["layer_types"] = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                for i in range(shape.num_hidden_layers)]
    return AutoConfig.for_model(
        shape.model_type, hidden_size=shape.hidden_size, num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads, num_key_value_heads=shape.num_key_value_heads,
        intermediate_size=shape.intermediate_size, head_dim=shape.head_dim, hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta, **shape.rope_scaling},
        tie_word_embeddings=shape.tie_word_embeddings, max_position_embeddings=shape.max_position_embeddings,
        rms_norm_eps=shape.rms_norm_eps, initializer_range=0.02, vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        architectures=[ARCHITECTURES[shape.model_type]],
        dtype=dtype, **extra)


def shape_folder_path(name: str, dtype: str) -> Path:
    """Where shape `name` in `dtype` is (or will be) kept."""
    return cache_root() / "bench_models" / f"{published_shape(name).name}_{dtype}"


def ensure_shape_folder(name: str, dtype: str = "float32", seed: int = 0) -> Path:
    """The HF folder of shape `name` in `dtype`, built the first time (seeded random weights, the default
    tokenizer) and found again afterwards. Built in a temporary folder and renamed into place: a crash never
    leaves a half-written model."""
    target = shape_folder_path(name, dtype)
    if _is_complete(target):
        return target
    print(f"[paged-hf bench] building the {name} shape in {dtype} once, in {target} (random weights) ...",
          file=sys.stderr, flush=True)
    tokenizer = AutoTokenizer.from_pretrained(ensure_default_checkpoint())
    config = shape_config(name, tokenizer, dtype)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
        num_params = sum(p.numel() for p in model.parameters())  # tied weights are one parameter, counted once
        model.save_pretrained(tmp)
        del model
        tokenizer.model_max_length = SERVING_MAX_LEN
        tokenizer.save_pretrained(tmp)
        info = {**asdict(published_shape(name)), "vocab_size": len(tokenizer), "num_params": num_params,
                "dtype": dtype, "seed": seed, "build_version": BUILD_VERSION}
        (tmp / MARKER).write_text(json.dumps(info, indent=2) + "\n")  # last: it marks the folder complete
        _publish(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def shape_info(folder: str | os.PathLike) -> dict:
    """What a built folder holds: the published numbers, its own vocab size and parameter count, dtype, seed."""
    return json.loads((Path(folder) / MARKER).read_text())


def _publish(tmp: Path, target: Path) -> None:
    """Rename the built `tmp` to `target`, unless another process finished the same shape meanwhile."""
    if _is_complete(target):
        return
    if target.exists():  # an outdated build
        shutil.rmtree(target)
    try:
        os.rename(tmp, target)
    except OSError:  # another process renamed its own build into place first
        if not _is_complete(target):
            raise


def _is_complete(folder: Path) -> bool:
    try:
        return shape_info(folder).get("build_version") == BUILD_VERSION and (folder / "config.json").is_file()
    except (OSError, ValueError):
        return False


def resolve_model_shape(args) -> dict | None:
    """`--model-shape NAME`: point ``args.model`` at the shape's folder (built if need be) and return what the
    report says of it; None without the flag. ``--model`` names another model, hence the error when both are
    given."""
    name = getattr(args, "model_shape", None)
    if not name:
        return None
    if args.model is not None:
        raise ValueError(f"--model-shape and --model are exclusive: --model-shape {name} builds its own model "
                         f"(random weights); drop --model {args.model}")
    published_shape(name)  # the error names the known shapes
    folder = ensure_shape_folder(name, args.dtype)
    args.model = str(folder)
    info = shape_info(folder)
    return {"name": name, "source": info["source"], "folder": str(folder), "num_params": info["num_params"],
            "vocab_size": info["vocab_size"], "published_vocab_size": info["published_vocab_size"]}


def describe_shape(shape: dict) -> str:
    """One line for the report and the plot: the shape, its size, and that its vocab is the default tokenizer's."""
    return (f"{shape['name']} shape, random weights, {shape['num_params'] / 1e9:.2f}B params (vocab "
            f"{shape['vocab_size']} of the default tokenizer; published {shape['published_vocab_size']})")
