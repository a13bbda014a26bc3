"""`--dtype auto` as vLLM resolves it: the checkpoint's dtype, bf16/fp16 on a CPU only where it computes them
natively (else float32, with a logged line), float32 checkpoints (the default model) float32.

The rule is tested with the CPU's flags given (the flag source is the only thing replaced: the checkpoint, the
loading and the engine are real), and once on this host's own flags, skipped where the CPU lacks bf16.
"""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import hf_greedy, tiny_model
from transformers import AutoModelForCausalLM

import paged_hf
from paged_hf import SamplingParams
from paged_hf.loader import device_dtype
from paged_hf.utils import cpu_flags, describe_host

pytest.importorskip("fastapi")
from tiny_server import tiny_tokenizer  # noqa: E402

AVX512 = frozenset({"avx2", "avx512f"})
ZEN5 = AVX512 | {"avx512_bf16"}
SAPPHIRE_RAPIDS = AVX512 | {"avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile"}
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPT = [1, 7, 40, 10, 3]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A small random Llama saved three times: in bfloat16, float16 and float32 (its config.json names each)."""
    folders = {}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        folder = tmp_path_factory.mktemp(f"tiny-{str(dtype).removeprefix('torch.')}")
        tiny_model("llama", dtype=dtype).save_pretrained(folder)
        tiny_tokenizer().save_pretrained(folder)
        folders[dtype] = str(folder)
    return folders


@pytest.fixture
def warnings_of_the_rule():
    """The lines device_dtype logs (transformers' loggers do not propagate to pytest's caplog)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    device_dtype.logger.addHandler(handler)
    yield records
    device_dtype.logger.removeHandler(handler)


def test_checkpoint_dtype_is_what_config_json_names(checkpoints):
    for dtype, folder in checkpoints.items():
        assert device_dtype.checkpoint_dtype(folder) is dtype
    assert device_dtype.checkpoint_dtype(None) is torch.float32  # the default model, dequantized from GGUF


@pytest.mark.parametrize(("stored", "flags", "expected", "why"), [
    (torch.bfloat16, ZEN5, torch.bfloat16, "avx512_bf16"),
    (torch.bfloat16, SAPPHIRE_RAPIDS, torch.bfloat16, "avx512_bf16, amx_bf16"),
    (torch.bfloat16, frozenset({"amx_bf16"}), torch.bfloat16, "amx_bf16"),
    (torch.bfloat16, AVX512, torch.float32, "no avx512_bf16/amx_bf16"),
    (torch.float16, SAPPHIRE_RAPIDS, torch.float16, "avx512_fp16"),
    (torch.float16, ZEN5, torch.float32, "no avx512_fp16/amx_fp16"),
    (torch.float32, SAPPHIRE_RAPIDS, torch.float32, "the checkpoint's float32"),
    (torch.float64, AVX512, torch.float64, "the checkpoint's float64"),
    (None, SAPPHIRE_RAPIDS, torch.float32, "names no dtype"),
])
def test_the_rule_on_cpu(stored, flags, expected, why):
    choice = device_dtype.choose_dtype("auto", "cpu", lambda: stored, flags)
    assert choice.dtype is expected and why in choice.reason, choice


def test_a_fallback_is_logged_and_an_explicit_dtype_is_kept(warnings_of_the_rule):
    assert device_dtype.choose_dtype("auto", "cpu", lambda: torch.bfloat16, AVX512).dtype is torch.float32
    (record,) = warnings_of_the_rule
    assert record.levelno == logging.WARNING and "float32" in record.getMessage()
    assert "--dtype bfloat16" in record.getMessage()
    explicit = device_dtype.choose_dtype("bfloat16", "cpu", lambda: pytest.fail("not asked"), AVX512)
    assert (explicit.dtype, explicit.reason) == (torch.bfloat16, "--dtype bfloat16")
    assert len(warnings_of_the_rule) == 1
    assert device_dtype.choose_dtype("auto", "cuda", lambda: torch.bfloat16, AVX512).dtype is torch.bfloat16
    with pytest.raises(ValueError, match="--dtype must be one of"):
        device_dtype.choose_dtype("bfloat17", "cpu")


def test_the_default_model_stays_float32_whatever_the_cpu(monkeypatch):
    monkeypatch.setattr(device_dtype, "cpu_flags", lambda: SAPPHIRE_RAPIDS)
    choice = device_dtype.resolve_model_dtype("auto", "cpu", None)
    assert choice.dtype is torch.float32 and "float32" in choice.reason


def test_llm_serves_a_bf16_checkpoint_in_bf16_where_native_and_float32_where_not(checkpoints, monkeypatch):
    """paged_hf.LLM with defaults on the bf16 checkpoint; the float32 fallback equals HF's float32 token for token."""
    folder = checkpoints[torch.bfloat16]
    monkeypatch.setattr(device_dtype, "cpu_flags", lambda: ZEN5)
    native = paged_hf.LLM(folder, device="cpu", num_blocks=16, max_model_len=64)
    assert native.paged_model.dtype is torch.bfloat16
    assert len(native.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 6

    monkeypatch.setattr(device_dtype, "cpu_flags", lambda: AVX512)
    fallback = paged_hf.LLM(folder, device="cpu", num_blocks=16, max_model_len=64)
    assert fallback.paged_model.dtype is torch.float32
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    out = fallback.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert out == hf_greedy(hf, PROMPT, 6)


def test_wrap_keeps_the_live_models_dtype(monkeypatch):
    monkeypatch.setattr(device_dtype, "cpu_flags", lambda: AVX512)  # no bf16 here: wrap() still does not cast
    model = tiny_model("llama", dtype=torch.bfloat16)
    assert paged_hf.wrap(model, num_blocks=8).dtype is torch.bfloat16


@pytest.mark.skipif(not device_dtype.cpu_has_native_bf16(), reason=f"this CPU has no native bf16: {describe_host()}")
def test_serve_with_defaults_runs_a_bf16_checkpoint_in_bf16_on_this_host(checkpoints, monkeypatch, capsys):
    """`paged-hf serve FOLDER` on this host's real flags: bfloat16, and the banner says so, why, and on which CPU."""
    pytest.importorskip("uvicorn")
    from paged_hf.entrypoints import cli  # noqa: PLC0415
    from paged_hf.serving.openai.lifecycle import DrainingServer  # noqa: PLC0415

    served = {}
    monkeypatch.setattr(DrainingServer, "run", lambda self: served.update(app=self.config.app))
    assert cli.main(["serve", checkpoints[torch.bfloat16], "--device", "cpu", "--num-blocks", "8"]) == 0
    assert served["app"].state.ctx.engine.generator.runner.model.dtype is torch.bfloat16
    banner = capsys.readouterr().err
    native = [flag for flag in ("avx512_bf16", "amx_bf16") if flag in cpu_flags()]
    assert "dtype bfloat16 (auto: the checkpoint's bfloat16, native on this CPU" in banner, banner
    assert all(flag in banner for flag in native) and describe_host() in banner, banner
