"""vLLM's extra routes: /tokenize, /detokenize, /version, /ping, runtime LoRA loading (only under the LoRA root:
path traversal refused), and the /metrics samples under vLLM's `vllm:` names."""

from __future__ import annotations

import os

import httpx
import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("peft")

from conftest import (  # noqa: E402
    assert_no_leak,
    hf_greedy,
    make_adapter,  # noqa: E402
    tiny_model,
)
from tiny_server import serving, tiny_tokenizer  # noqa: E402

import paged_hf  # noqa: E402
from paged_hf.serving.openai import ServerSettings, create_app  # noqa: E402

KEY = "k"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def routes_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    outside = tmp_path_factory.mktemp("outside")
    base = tiny_model("llama", dtype=torch.float32)
    oracle = make_adapter(base, root / "tenant", seed=1, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    make_adapter(base, outside / "evil", seed=2, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    os.symlink(outside / "evil", root / "link-out")
    generator = paged_hf.wrap(base, tiny_tokenizer(), num_blocks=64, max_model_len=128, lora_root=str(root)).generator
    app = create_app(generator, generator.tokenizer, ["tiny", "tiny-alias"], ServerSettings(api_key=KEY))
    with serving(app) as url:
        yield url, base, oracle, outside
    assert_no_leak(generator)


def post(server, path, body, headers=AUTH):
    return httpx.post(server[0] + path, json=body, headers=headers, timeout=60)


def test_tokenize_detokenize_version_ping(routes_server):
    url = routes_server[0]
    tok = post(routes_server, "/tokenize", {"prompt": "the time", "return_token_strs": True}).json()
    assert tok["tokens"] == tiny_tokenizer()("the time")["input_ids"] and tok["count"] == len(tok["tokens"]) == 2
    assert tok["token_strs"] == ["the", "time"] and tok["max_model_len"] == 128
    chat = post(routes_server, "/tokenize", {"messages": [{"role": "user", "content": "the"}]}).json()
    assert chat["tokens"] == tiny_tokenizer().encode("<user> the <assistant>", add_special_tokens=False)
    assert post(routes_server, "/detokenize", {"tokens": tok["tokens"]}).json() == {"prompt": "the time"}
    assert post(routes_server, "/detokenize", {"tokens": [5, 999]}).status_code == 400
    assert post(routes_server, "/tokenize", {"prompt": "the", "model": "nope"}).status_code == 404
    assert post(routes_server, "/tokenize", {"prompt": "the", "tokens": [1]}).status_code == 400
    tools = [{"type": "function", "function": {"name": "clock", "description": "the time",
                                               "parameters": {"type": "object", "properties": {}}}}]
    messages = [{"role": "user", "content": "the"}]
    with_tools = post(routes_server, "/tokenize", {"messages": messages, "tools": tools}).json()["count"]
    answer = post(routes_server, "/v1/chat/completions", {"messages": messages, "tools": tools,
                                                          "max_tokens": 1}).json()
    assert with_tools == answer["usage"]["prompt_tokens"] > chat["count"]  # the tools are in the prompt
    assert httpx.get(url + "/version", headers=AUTH).json()["version"] == paged_hf.__version__
    assert httpx.get(url + "/ping").status_code == 200 and httpx.post(url + "/ping").status_code == 200


def test_request_chat_templates_need_the_trust_flag(routes_server):
    """A chat template is a program: without --trust-request-chat-template a request's own is refused, on the
    generation routes and /tokenize alike, before anything renders."""
    messages = [{"role": "user", "content": "the"}]
    for path, body in (("/tokenize", {"messages": messages}),
                       ("/v1/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": 2})):
        response = post(routes_server, path, {**body, "chat_template": "{{ messages[0]['content'] }}"})
        assert response.status_code == 400 and "--trust-request-chat-template" in response.text, response.text
        assert response.json()["error"]["param"] == "chat_template"
        assert post(routes_server, path, body).status_code == 200


def test_runtime_lora_load_and_unload(routes_server):
    """A folder under the engine's lora_root is served by its own name; /v1/load_lora_adapter serves it under
    another name until it is unloaded (the root is one engine field: `--lora-root` sets both)."""
    url, base, oracle, outside = routes_server
    prompt = [1, 7, 40, 10, 22]
    body = {"model": "mine", "prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    expected = tiny_tokenizer().decode(hf_greedy(oracle, prompt, 5), skip_special_tokens=True)
    assert post(routes_server, "/v1/completions", body).status_code == 404
    assert post(routes_server, "/v1/completions", {**body, "model": "tenant"}).json()["choices"][0]["text"] == expected
    r = post(routes_server, "/v1/load_lora_adapter", {"lora_name": "mine", "lora_path": "tenant"})
    assert r.status_code == 200, r.text
    models = httpx.get(url + "/v1/models", headers=AUTH).json()["data"]
    assert sorted(m["id"] for m in models) == ["mine", "tenant", "tiny", "tiny-alias"]  # tenant: read on its use
    text = post(routes_server, "/v1/completions", body).json()["choices"][0]["text"]
    assert text == expected
    again = post(routes_server, "/v1/load_lora_adapter", {"lora_name": "mine", "lora_path": "tenant"})
    assert again.status_code == 400
    assert post(routes_server, "/v1/unload_lora_adapter", {"lora_name": "mine"}).status_code == 200
    assert post(routes_server, "/v1/completions", body).status_code == 404
    assert post(routes_server, "/v1/unload_lora_adapter", {"lora_name": "mine"}).status_code == 404


@pytest.mark.parametrize("path", ["../outside/evil", "/etc", "link-out", ".", "missing"])
def test_lora_paths_outside_the_root_are_refused(routes_server, path):
    if path == "../outside/evil":
        path = os.path.relpath(routes_server[3] / "evil", os.path.realpath(routes_server[3].parent))
        path = os.path.join("..", path)
    r = post(routes_server, "/v1/load_lora_adapter", {"lora_name": "evil", "lora_path": path})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text
    absolute = post(routes_server, "/v1/load_lora_adapter", {"lora_name": "evil",
                                                             "lora_path": str(routes_server[3] / "evil")})
    assert absolute.status_code == 400
    assert "evil" not in [m["id"] for m in httpx.get(routes_server[0] + "/v1/models", headers=AUTH).json()["data"]]


def test_lora_routes_are_off_without_a_root():
    generator = paged_hf.wrap(tiny_model("llama", dtype=torch.float32), tiny_tokenizer(), num_blocks=16).generator
    with serving(create_app(generator, generator.tokenizer, "tiny", ServerSettings())) as url:
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/tmp"}, timeout=30)
        assert r.status_code == 404


def test_metrics_under_vllm_names(routes_server):
    post(routes_server, "/v1/completions", {"model": "tiny", "prompt": "the", "max_tokens": 3})
    text = httpx.get(routes_server[0] + "/metrics", headers=AUTH).text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:time_per_output_token_seconds_count",
                 "vllm:e2e_request_latency_seconds_sum", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
        assert f'{name}{{model_name="tiny"' in text, name
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert samples['vllm:prompt_tokens_total{model_name="tiny"}'] == samples["paged_hf_prompt_tokens_total"]
    assert "# TYPE vllm:time_to_first_token_seconds histogram" in text


def test_adapters_under_the_engines_lora_root_are_served_by_name(tmp_path):
    """`paged-hf serve --lora-root DIR`: model=NAME serves DIR/NAME with no load call; /metrics shows the
    adapter levels and vLLM's lora_requests_info."""
    base = tiny_model("llama", dtype=torch.float32)
    oracle = make_adapter(base, tmp_path / "tenant", seed=1, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    generator = paged_hf.wrap(base, tiny_tokenizer(), num_blocks=64, max_model_len=128, lora_root=str(tmp_path),
                              max_cpu_loras=1).generator
    prompt = [1, 7, 40, 10, 22]
    body = {"model": "tenant", "prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    with serving(create_app(generator, generator.tokenizer, "tiny", ServerSettings())) as url:
        response = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == tiny_tokenizer().decode(hf_greedy(oracle, prompt, 5),
                                                                                 skip_special_tokens=True)
        assert httpx.post(url + "/v1/completions", json={**body, "model": "../tenant"}, timeout=60).status_code == 404
        metrics = httpx.get(url + "/metrics", timeout=60).text
        assert "paged_hf_lora_loads_total 1" in metrics and "paged_hf_lora_in_memory 1" in metrics
        assert 'vllm:lora_requests_info{model_name="tiny",max_lora="4"' in metrics
    assert_no_leak(generator)
