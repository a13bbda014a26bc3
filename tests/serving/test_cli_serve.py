"""`paged-hf serve` as vLLM users type it: positional MODEL, --device/--dtype auto, vLLM's flag spellings,
several served names, --chat-template, sampling defaults from generation_config.json, the API key from the
environment, CORS, and a queue that takes `vllm bench serve`'s 1000 prompts."""

from __future__ import annotations

import httpx
import pytest
import torch

uvicorn = pytest.importorskip("uvicorn")

from conftest import tiny_model  # noqa: E402
from tiny_server import serving, tiny_tokenizer  # noqa: E402

from paged_hf.entrypoints import cli
from paged_hf.entrypoints.cli_args import engine_config  # noqa: E402
from paged_hf.loader import device_dtype  # noqa: E402
from paged_hf.serving.openai.lifecycle import DrainingServer  # noqa: E402


@pytest.fixture
def served(monkeypatch):
    """Runs `paged-hf serve ARGS` on the tiny model; returns (ctx, loaded (name, dtype, device), app)."""
    from paged_hf.loader import default_model

    loads, result = [], {}

    def load(name, dtype, device):
        loads.append((name, dtype, device))
        model = tiny_model("llama", dtype=torch.float32)
        model.generation_config.temperature = 0.25
        model.generation_config.max_new_tokens = 7
        return model, tiny_tokenizer()

    monkeypatch.setattr(default_model, "load_model", load)
    monkeypatch.setattr(device_dtype, "checkpoint_dtype", lambda name: None)  # the fake names have no config.json
    monkeypatch.setattr(DrainingServer, "run", lambda self: result.update(app=self.config.app))

    def run(*argv):
        assert cli.main(["serve", *argv, "--num-blocks", "64", "--max-model-len", "128"]) == 0
        return result["app"].state.ctx, loads[-1], result["app"]

    return run


def test_positional_model_auto_device_and_dtype(served):
    ctx, (name, dtype, device), _ = served("some/model")
    assert (name, dtype, device) == ("some/model", torch.float32, "cuda" if torch.cuda.is_available() else "cpu")
    assert ctx.model_name == "some/model" and ctx.settings.max_queue >= 1000
    with pytest.raises(SystemExit):
        cli.main(["serve", "--dtype", "float33"])


def test_dtype_auto_rule():
    """The rule itself is tested in tests/loader/test_dtype_auto.py; here: the GPU and the explicit cases."""
    assert device_dtype.resolve_dtype("auto", "cuda", lambda: torch.bfloat16) is torch.bfloat16
    assert device_dtype.resolve_dtype("auto", "cuda", lambda: None) is torch.float32
    assert device_dtype.resolve_dtype("bf16", "cpu") is torch.bfloat16
    no_bf16, bf16 = frozenset({"avx512f"}), frozenset({"avx512f", "avx512_bf16"})
    assert device_dtype.choose_dtype("auto", "cpu", lambda: torch.bfloat16, no_bf16).dtype is torch.float32
    assert device_dtype.choose_dtype("auto", "cpu", lambda: torch.bfloat16, bf16).dtype is torch.bfloat16


def test_vllm_spellings(served, tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }} {% endfor %}")
    ctx, _, _ = served("--model", "m", "--served-model-name", "a", "b", "--enable-prefix-caching",
                       "--chat-template", str(template), "--allowed-origins", '["https://x.example"]')
    assert ctx.served_names == ("a", "b") and ctx.model_name == "a"
    assert ctx.resolve_model("b") is None and ctx.resolve_model("a") is None
    assert ctx.settings.chat_template == template.read_text()
    assert ctx.engine.generator.config.enable_prefix_caching
    assert ctx.settings.cors_origins == ("https://x.example",)
    ctx, _, _ = served("--no-enable-prefix-caching", "--chat-template", "{{ messages[0]['content'] }}")
    assert not ctx.engine.generator.config.enable_prefix_caching
    assert cli.main(["serve", "--chat-template", "no-such-file.jinja"]) == 2
    assert cli.main(["serve", "m1", "--model", "m2"]) == 2


def test_lora_modules_flag():
    args = cli.build_parser().parse_args(["serve", "--lora-modules", "a=/x", '{"name": "b", "path": "/y"}',
                                          "--adapter", "c=/z"])
    assert engine_config(args)["adapters"] == {"a": "/x", "b": "/y", "c": "/z"}


def test_api_key_from_environment_cors_and_generation_defaults(served, monkeypatch):
    monkeypatch.setenv("PAGED_HF_API_KEY", "env-key")
    ctx, _, app = served("--allowed-origins", "https://ui.example")
    assert ctx.settings.api_key == "env-key"
    assert ctx.settings.sampling_defaults == {"temperature": 0.25, "max_tokens": 7}
    with serving(app) as url:
        assert httpx.get(url + "/v1/models").status_code == 401
        preflight = httpx.options(url + "/v1/completions", headers={
            "Origin": "https://ui.example", "Access-Control-Request-Method": "POST"})
        assert preflight.headers.get("access-control-allow-origin") == "https://ui.example"
        body = httpx.post(url + "/v1/completions", json={"prompt": "the", "seed": 1},
                          headers={"Authorization": "Bearer env-key"}, timeout=60).json()
        assert body["usage"]["completion_tokens"] <= 7  # generation_config's max_new_tokens is the default
        ctx.settings.sampling_defaults = {}
        body = httpx.post(url + "/v1/completions", json={"prompt": "the", "seed": 1, "ignore_eos": True},
                          headers={"Authorization": "Bearer env-key"}, timeout=60).json()
        assert body["usage"]["completion_tokens"] > 7
