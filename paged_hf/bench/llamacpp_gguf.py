"""The model as llama.cpp reads it: GGUF files converted once per model and type, and cached.

How, as a llama.cpp user would: llama.cpp's own ``convert_hf_to_gguf.py`` (run in the converter's venv, which
`make bench-llamacpp` builds: it pins an older transformers than paged_hf's) writes f32, bf16 and q8_0 straight
from the HF checkpoint; ``llama-quantize`` makes q4_0 from the f32 file (its defaults: the output tensor of a
q4_0 model is kept in a wider type, as every user of `llama-quantize ... Q4_0` gets). The default model is the
plain checkpoint paged_hf loads (the fp32 weights of its GGUF, `ensure_default_checkpoint`), so both engines run
the same weights.

The cache: ``.llamacpp/gguf/<folder name>-<hash of its path>/<type>.gguf``, and beside each file a JSON with the
bytes one decode step reads (every tensor once; the token embedding's table only where the output layer is the
same tensor, a step reads one row of it otherwise), which the bench's memory-read fraction needs.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

from paged_hf.bench.llamacpp import LlamaCpp
from paged_hf.loader.default_model import ensure_default_checkpoint, is_default_model

#: GGUF types the bench runs, and how each is made: convert_hf_to_gguf's --outtype, or llama-quantize's type
CONVERTED = {"f32": "f32", "bf16": "bf16", "q8_0": "q8_0"}
QUANTIZED = {"q4_0": "Q4_0"}

_STEP_BYTES_SCRIPT = """
import json, sys
from gguf import GGUFReader
tensors = {t.name: int(t.n_bytes) for t in GGUFReader(sys.argv[1]).tensors}
tied = "output.weight" not in tensors
step = sum(n for name, n in tensors.items() if tied or name != "token_embd.weight")
print(json.dumps({"file_tensor_bytes": sum(tensors.values()), "step_weight_bytes": step, "tied_output": tied}))
"""


def model_folder(model: str | None) -> Path:
    """The HF checkpoint folder to convert: the default model's plain checkpoint, or the folder given."""
    folder = Path(ensure_default_checkpoint() if is_default_model(model) else model)
    if not (folder / "config.json").exists():
        raise ValueError(f"llama.cpp's converter needs a local HF checkpoint folder; {model!r} is not one")
    return folder


def cache_folder(build: LlamaCpp, folder: Path) -> Path:
    """One folder per checkpoint: its name and a hash of its path and its config's modification time."""
    key = f"{folder.resolve()}:{(folder / 'config.json').stat().st_mtime_ns}"
    return build.gguf_cache / f"{folder.name}-{hashlib.sha1(key.encode()).hexdigest()[:10]}"


def _run(command: list, timeout_s: float | None, env: dict | None = None) -> str:
    proc = subprocess.run([str(part) for part in command], capture_output=True, text=True, timeout=timeout_s,
                          check=False, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, command[:3]))} ... exited with code {proc.returncode}: "
                           f"{(proc.stdout + proc.stderr)[-2000:]}")
    return proc.stdout


def converter_folder(folder: Path, staging: Path) -> Path:
    """What the converter reads: `folder` itself, or, where its tokenizer was saved by transformers 5 (class
    `TokenizersBackend`, which the converter's transformers 4 does not know), a staging folder of links to its
    files with the same tokenizer config naming `PreTrainedTokenizerFast` (the same tokenizer.json, read by 4.x)."""
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    if config.get("tokenizer_class") != "TokenizersBackend":
        return folder
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for path in folder.iterdir():
        if path.name != config_path.name:
            (staging / path.name).symlink_to(path.resolve())
    (staging / config_path.name).write_text(json.dumps(dict(config, tokenizer_class="PreTrainedTokenizerFast")))
    return staging


def _make(build: LlamaCpp, folder: Path, gguf_type: str, target: Path, timeout_s: float | None) -> None:
    partial = target.with_name(target.name + ".partial")
    if gguf_type in CONVERTED:
        script = build.source / "convert_hf_to_gguf.py"
        env = dict(os.environ, NO_LOCAL_GGUF="1")  # the venv's gguf, installed from the same gguf-py
        source = converter_folder(folder, target.parent / "checkpoint")
        _run([build.converter_python, script, source, "--outfile", partial, "--outtype", CONVERTED[gguf_type]],
             timeout_s, env)
    elif gguf_type in QUANTIZED:
        source = gguf_file(build, folder, "f32", timeout_s)
        _run([build.tool("llama-quantize"), source, partial, QUANTIZED[gguf_type]], timeout_s)
    else:
        raise ValueError(f"unknown GGUF type {gguf_type!r}; known: {', '.join([*CONVERTED, *QUANTIZED])}")
    partial.replace(target)  # a file in the cache is always whole


def gguf_file(build: LlamaCpp, folder: Path, gguf_type: str, timeout_s: float | None = None) -> Path:
    """The checkpoint as a GGUF file of `gguf_type`, converted on first use and cached."""
    target = cache_folder(build, folder) / f"{gguf_type}.gguf"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        _make(build, folder, gguf_type, target, timeout_s)
    return target


def step_weight_bytes(build: LlamaCpp, gguf: Path) -> dict:
    """The bytes one decode step of one sequence reads from `gguf` (read with gguf-py once, then cached)."""
    cached = gguf.with_suffix(".json")
    if cached.exists():
        return json.loads(cached.read_text())
    result = json.loads(_run([build.converter_python, "-c", _STEP_BYTES_SCRIPT, gguf], 600).strip().splitlines()[-1])
    cached.write_text(json.dumps(result))
    return result
