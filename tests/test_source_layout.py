"""The checkout's top-level `kernels/` and `integrations/` never stand in for packages of their own names.

`python -c`, `python -m`, a REPL and pytest put the working directory first on `sys.path`. From the checkout's
root, `import kernels` must still give HuggingFace's hub-kernels package (transformers imports it from 5.25 on),
and paged_hf must still find its own kernels (paged_hf/source_layout.py). This test process is itself one such
run (`python -m pytest` from the root); the subprocesses below start the others from the root too.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from conftest import tiny_model
from tiny_server import tiny_tokenizer

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str, cwd: Path = ROOT, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, f"{args} failed:\n{result.stdout}\n{result.stderr}"
    return result


def test_from_the_checkouts_root_kernels_is_huggingfaces_and_paged_hf_finds_its_own():
    """With HuggingFace's `kernels` installed (transformers >= 5.25 requires it), `import kernels` gives it; without
    it, the folder is a namespace portion with no file, which transformers reads as "not installed"."""
    check = ("import json, sys, kernels\n"
             "from transformers import PreTrainedModel\n"
             "from transformers.utils import is_kernels_available\n"
             "import paged_hf.kernels, paged_hf.integrations\n"
             "from paged_hf.kernels import native\n"
             "print(json.dumps({'first_path': sys.path[0], 'kernels': getattr(kernels, '__file__', None),\n"
             "                  'available': is_kernels_available(),\n"
             "                  'ours': list(paged_hf.kernels.__path__), 'native': native.__file__,\n"
             "                  'integrations': list(paged_hf.integrations.__path__)}))\n")
    found = json.loads(_run("-c", check).stdout)
    assert found["first_path"] in ("", str(ROOT))  # the root is searched first
    if _installed("kernels"):
        assert "site-packages" in Path(found["kernels"]).parts  # HuggingFace's, not the checkout's folder
    else:
        assert found["kernels"] is None and not found["available"]
    assert found["ours"] == [str(ROOT / "kernels")] and found["integrations"] == [str(ROOT / "integrations")]
    assert Path(found["native"]) == ROOT / "kernels" / "native.py"


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_neither_folder_is_a_regular_package():
    """A folder with an __init__.py on sys.path is a regular package, which wins over any installed one."""
    assert not (ROOT / "kernels" / "__init__.py").exists()
    assert not (ROOT / "integrations" / "__init__.py").exists()


def test_python_m_paged_hf_generate_answers_from_the_checkouts_root(tmp_path):
    model_dir = tmp_path / "tiny-llama"
    tiny_model("llama", dtype=torch.float32).save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps({"prompt": "the cat", "max_new_tokens": 3, "temperature": 0}) + "\n")
    result = _run("-m", "paged_hf", "generate", str(requests), "--model", str(model_dir), "--num-blocks", "16",
                  "--quiet")
    (answer,) = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(answer["token_ids"]) == 3, answer
