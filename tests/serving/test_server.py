"""The OpenAI-compatible server, end to end: a real uvicorn server in a thread, the real `openai` client, a tiny
random Llama and a word-level tokenizer built in memory (no hub, no slow conversion)."""

from __future__ import annotations

import copy
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from conftest import assert_no_leak, hf_greedy, tiny_model  # noqa: E402
from tiny_server import API_KEY, MODEL, WORDS, free_port, serving, tiny_tokenizer  # noqa: E402,F401

import paged_hf  # noqa: E402
from paged_hf.serving.openai import ServerSettings, create_app  # noqa: E402


@pytest.fixture(scope="module")
def server():
    """(base_url, generator, app, model) of a server running for the whole module; checks for leaks at the end."""
    model = tiny_model("llama", dtype=torch.float32)
    generator = paged_hf.wrap(model, tiny_tokenizer(), num_blocks=128, block_size=16, max_num_seqs=32,
                              max_num_batched_tokens=256, max_model_len=512).generator
    settings = ServerSettings(api_key=API_KEY, max_body_bytes=64 << 10, max_n=4, max_tokens_cap=450, max_queue=128)
    app = create_app(generator, generator.tokenizer, MODEL, settings)
    with serving(app) as url:
        yield url, generator, app, model
    assert_no_leak(generator)  # engine thread gone: safe to look at the generator directly


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def post(server, path: str, body, key: str | None = API_KEY, timeout=60) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if isinstance(body, (dict, list)):
        return httpx.post(server[0] + path, json=body, headers=headers, timeout=timeout)
    return httpx.post(server[0] + path, content=body, headers={**headers, "Content-Type": "application/json"},
                      timeout=timeout)


def metrics(server) -> dict[str, float]:
    text = httpx.get(server[0] + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30).text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def wait_until_idle(server, timeout: float = 20.0) -> dict[str, float]:
    """Poll /metrics until every block is free and nothing runs: no leak, no stuck request."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if (m["paged_hf_num_free_blocks"] == m["paged_hf_num_blocks"] and m["paged_hf_num_requests_running"] == 0
                and m["paged_hf_num_requests_in_flight"] == 0):
            return m
        assert time.monotonic() < deadline, f"blocks not freed: {m}"
        time.sleep(0.05)


CHAT = [{"role": "system", "content": "you are a good man"}, {"role": "user", "content": "tell me the time"}]


def test_models_list(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]  # no adapter loaded: just the base model
    assert models.data[0].model_extra["max_model_len"] == 512  # (Open WebUI and Continue size chats by it)


def test_chat_streamed_text_equals_non_streamed(client):
    full = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=20)
    choice = full.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant" and choice.message.content
    assert full.usage.completion_tokens == 20 and full.usage.prompt_tokens > 0
    pieces, finish, usage = [], None, None
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=20, stream=True,
                                            stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(pieces) == choice.message.content
    assert finish == "length" and usage.total_tokens == full.usage.total_tokens


def test_completions_text_tokens_logprobs_and_n(client):
    out = client.completions.create(model=MODEL, prompt="the time of day", max_tokens=8, temperature=0)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 8
    by_ids = client.completions.create(model=MODEL, prompt=[1, 7, 40, 10], max_tokens=8, temperature=0, logprobs=2)
    lp = by_ids.choices[0].logprobs
    assert len(lp.tokens) == 8 and all(v <= 0 for v in lp.token_logprobs)
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    many = client.completions.create(model=MODEL, prompt="the time", max_tokens=5, n=3, seed=7, temperature=1.0)
    assert sorted(c.index for c in many.choices) == [0, 1, 2] and many.usage.completion_tokens == 15
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)


def test_stop_string_cuts_text_and_streams_the_same(client):
    """The stop string (a word the greedy answer contains) is cut from the text, streamed or not."""
    prompt = "the time of day"
    words = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0).choices[0].text.split()
    # a word that is no substring of the text before it: the first match starts exactly at that word
    index = next(i for i in range(2, len(words)) if words[i] not in " ".join(words[:i]))
    stop = words[index]
    cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[stop, "zzz"])
    assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].text
    assert cut.choices[0].text.split() == words[:index]
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[stop, "zzz"],
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == cut.choices[0].text


def test_48_concurrent_requests_over_24_threads(server, client):
    def one(i: int):
        if i % 2:
            r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"say {i} word"}],
                                               max_tokens=6 + i % 5, temperature=0.8, seed=i)
            return r.choices[0].finish_reason, r.usage.completion_tokens, 6 + i % 5
        r = client.completions.create(model=MODEL, prompt=f"the {i} water", max_tokens=4 + i % 7, stream=False)
        return r.choices[0].finish_reason, r.usage.completion_tokens, 4 + i % 7

    with ThreadPoolExecutor(24) as pool:
        results = list(pool.map(one, range(48)))
    # the random model may sample EOS (id 2) before max_tokens: "stop" early is success too
    assert all((reason == "length" and got == wanted) or (reason == "stop" and 0 < got <= wanted)
               for reason, got, wanted in results), results
    wait_until_idle(server)


def test_api_key_required_everywhere_but_health(server):
    base = server[0]
    for key in (None, "wrong-key"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions"),
                             ("POST", "/v1/chat/completions")):
            r = httpx.request(method, base + path, headers=headers, json={"model": MODEL, "prompt": "the"})
            assert r.status_code == 401, (path, r.text)
            assert r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(base + "/health").status_code == 200
    bad = openai.OpenAI(base_url=base + "/v1", api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


BAD_INPUTS = [
    (400, "/v1/completions", {"model": MODEL, "prompt": "the", "max_tokens": -1}, "max_tokens"),
    (400, "/v1/completions", {"model": MODEL, "prompt": "the", "temperature": -0.5}, "temperature"),
    (400, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "top_p": 1.5}, "top_p"),
    (404, "/v1/chat/completions", {"model": "no-such-model", "messages": CHAT}, "model"),
    (400, "/v1/completions", b'{"model": "tiny-llama", "prompt": ', None),
    (400, "/v1/completions", {"model": MODEL, "prompt": list(range(3, 100)) * 6}, "prompt"),  # 582 > 512 tokens
    (400, "/v1/completions", {"model": MODEL, "prompt": [5, 999]}, None),  # token id outside the vocabulary
    (400, "/v1/completions", {"model": MODEL, "prompt": "the", "max_tokens": 500}, "max_tokens"),  # over the cap
    (400, "/v1/completions", {"model": MODEL, "prompt": "the", "n": 9}, "n"),  # over --max-n
    (400, "/v1/chat/completions", {"model": MODEL, "messages": []}, "messages"),
    (400, "/v1/chat/completions", {"model": MODEL}, "messages"),
    (413, "/v1/completions", {"model": MODEL, "prompt": "the " * 20000}, None),
    (400, "/v1/completions", {"model": MODEL, "prompt": "the", "stop": [f"s{i}" for i in range(65)]}, "max_stop_strings"),
    (400, "/v1/completions", {"model": MODEL, "prompt": "the", "stop": ["x" * 513]}, "max_stop_string_chars"),
]


@pytest.mark.parametrize("status, path, body, param", BAD_INPUTS)
def test_bad_input_gets_openai_error_and_server_keeps_serving(server, client, status, path, body, param):
    r = post(server, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) >= {"message", "type", "code"} and error["message"]
    if param is not None:
        assert param in error["message"] or error.get("param") == param, error
    ok = client.completions.create(model=MODEL, prompt="the", max_tokens=3)
    assert ok.choices[0].finish_reason == "length"


def test_queue_full_is_503(server):
    engine = server[2].state.ctx.engine
    engine.max_queue, saved = 0, engine.max_queue
    try:
        r = post(server, "/v1/completions", {"model": MODEL, "prompt": "the", "max_tokens": 2})
    finally:
        engine.max_queue = saved
    assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"


def test_client_disconnect_mid_stream_frees_blocks(server):
    before = metrics(server).get('paged_hf_sequences_finished_total{finish_reason="abort"}', 0)
    body = {"model": MODEL, "prompt": "the long way", "max_tokens": 450, "stream": True, "temperature": 0}
    with httpx.stream("POST", server[0] + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        assert r.status_code == 200
        seen = []
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen.append(json.loads(line[6:]))
            if len(seen) >= 3:
                break
    assert len(seen) >= 3 and all(c["choices"][0]["finish_reason"] is None for c in seen)
    m = wait_until_idle(server)
    assert m['paged_hf_sequences_finished_total{finish_reason="abort"}'] == before + 1


def test_client_disconnect_while_waiting_non_streamed_aborts(server):
    """A non-streamed request whose client gives up is noticed by the disconnect poll and aborted too."""
    before = metrics(server).get('paged_hf_sequences_finished_total{finish_reason="abort"}', 0)
    body = {"model": MODEL, "prompt": "the long way", "max_tokens": 450, "n": 4, "temperature": 0}
    # at least 5 ms a step: the 450 steps cannot end before the client's 0.2 s (the tiny model alone can)
    handle = server[3].register_forward_pre_hook(lambda module, args: time.sleep(0.005))
    try:
        with pytest.raises(httpx.ReadTimeout):
            post(server, "/v1/completions", body, timeout=httpx.Timeout(30, read=0.2))
        m = wait_until_idle(server)
    finally:
        handle.remove()
    assert m['paged_hf_sequences_finished_total{finish_reason="abort"}'] == before + 4


def test_model_failure_is_500_for_its_requests_and_the_server_recovers(server, client):
    """An exception inside the model is the server's fault (500), aborts the running requests, leaks nothing."""
    model = server[3]
    failing = {"on": True}

    def fail(module, args, kwargs):
        if failing["on"]:
            raise RuntimeError("boom")

    handle = model.register_forward_pre_hook(fail, with_kwargs=True)
    try:
        r = post(server, "/v1/completions", {"model": MODEL, "prompt": "the", "max_tokens": 5})
    finally:
        failing["on"] = False
        handle.remove()
    assert r.status_code == 500 and "boom" in r.json()["error"]["message"]
    wait_until_idle(server)
    assert client.completions.create(model=MODEL, prompt="the", max_tokens=3).usage.completion_tokens == 3


def test_metrics_exposition(server, client):
    client.completions.create(model=MODEL, prompt="the time", max_tokens=4)
    m = metrics(server)
    for name in ("paged_hf_time_to_first_token_seconds_count", "paged_hf_inter_token_latency_seconds_count",
                 "paged_hf_e2e_request_latency_seconds_count", "paged_hf_request_queue_time_seconds_count"):
        assert m[name] > 0, name
    for name in ("paged_hf_num_requests_running", "paged_hf_num_requests_waiting", "paged_hf_kv_cache_usage_perc",
                 "paged_hf_prefix_cache_queries_total", "paged_hf_prefix_cache_hits_total",
                 "paged_hf_num_preemptions_total", "paged_hf_time_to_first_token_seconds_bucket{le=\"+Inf\"}"):
        assert name in m, name
    assert m[f'paged_hf_requests_total{{model="{MODEL}",adapter=""}}'] >= 1
    assert m['paged_hf_request_errors_total{status="401"}'] >= 1  # test_api_key_required... ran before


def test_adapters_are_served_under_their_own_model_names(tmp_path):
    """A LoRA adapter is a model name: listed in /v1/models, and its requests get the adapter's tokens."""
    peft = pytest.importorskip("peft")
    base, tokenizer = tiny_model("llama", dtype=torch.float32), tiny_tokenizer()
    oracle = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # peft starts lora_B at zero, which would make the adapter a no-op
        for name, param in oracle.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(1)) * 0.3)
    oracle.save_pretrained(str(tmp_path / "tenant-a"))
    generator = paged_hf.wrap(base, tokenizer, num_blocks=64, max_model_len=256,
                              adapters={"tenant-a": str(tmp_path / "tenant-a")}).generator
    prompt = [1, 7, 40, 10, 22]
    with serving(create_app(generator, tokenizer, MODEL, ServerSettings())) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        assert [(m.id, m.model_extra["max_model_len"]) for m in client.models.list().data] == [
            (MODEL, 256), ("tenant-a", 256)]
        texts = {}
        for name, reference in ((MODEL, base), ("tenant-a", oracle.eval())):
            out = client.completions.create(model=name, prompt=prompt, max_tokens=6, temperature=0,
                                            extra_body={"ignore_eos": True})
            texts[name] = out.choices[0].text
            assert texts[name] == tokenizer.decode(hf_greedy(reference, prompt, 6), skip_special_tokens=True)
        assert texts[MODEL] != texts["tenant-a"]  # the adapter really changes the answer
        text = httpx.get(url + "/metrics").text
        assert 'paged_hf_requests_total{model="tenant-a",adapter="tenant-a"} 1' in text
    assert_no_leak(generator)


# --- the `paged-hf serve` command ----------------------------------------------------------------------------

@pytest.fixture
def tiny_load_model(monkeypatch):
    """`paged-hf serve` on the tiny model instead of the default one (no download, no conversion)."""
    from paged_hf.loader import default_model

    monkeypatch.setattr(default_model, "load_model",
                        lambda name, dtype, device: (tiny_model("llama", dtype=torch.float32), tiny_tokenizer()))


def test_cli_serve_builds_the_app_from_its_flags(tiny_load_model, monkeypatch):
    from paged_hf.entrypoints import cli
    from paged_hf.serving.openai.lifecycle import DrainingServer

    served = {}
    monkeypatch.setattr(DrainingServer, "run", lambda self: served.update(
        app=self.config.app, port=self.config.port, host=self.config.host, grace=self.grace_s))
    argv = ["serve", "--port", "8123", "--shutdown-grace", "2.5", "--api-key", "k", "--max-n", "2", "--max-queue", "7", "--max-tokens-cap", "0",
            "--num-blocks", "40", "--max-model-len", "256", "--served-model-name", "tiny", "--max-loras", "3"]
    assert cli.main(argv) == 0
    ctx = served["app"].state.ctx
    assert served["port"] == 8123 and served["host"] == "127.0.0.1" and served["grace"] == 2.5
    assert (ctx.model_name, ctx.max_model_len, ctx.engine.stats["num_blocks"]) == ("tiny", 256, 40)
    assert ctx.engine.generator.config.max_loras == 3
    assert (ctx.settings.api_key, ctx.settings.max_n, ctx.settings.max_queue, ctx.settings.max_tokens_cap) == (
        "k", 2, 7, None)


def test_cli_serve_fails_at_startup_for_an_adapter_it_cannot_serve(tiny_load_model, monkeypatch, tmp_path, capsys):
    from paged_hf.entrypoints import cli
    from paged_hf.serving.openai.lifecycle import DrainingServer

    monkeypatch.setattr(DrainingServer, "run", lambda self: pytest.fail("must not start serving"))
    assert cli.main(["serve", "--adapter", f"tenant={tmp_path / 'missing'}", "--num-blocks", "8"]) == 2
    assert "adapter" in capsys.readouterr().err.lower()


def test_stream_sends_each_sequence_finish_once():
    """With n > 1 a finished sequence stays in every later output; its finish goes out once, the others go on."""
    from paged_hf.outputs import CompletionOutput, RequestOutput
    from paged_hf.serving.openai.logprobs import Deltas

    deltas = Deltas()

    def step(*outputs):
        output = RequestOutput("r", [1], list(outputs), finished=False)
        return [(c.index, text, ids, c.finish_reason) for c, text, ids, _ in deltas.new_pieces(output)]

    assert step(CompletionOutput(0, [5], "a", "length"), CompletionOutput(1, [6], "b")) == [
        (0, "a", [5], "length"), (1, "b", [6], None)]
    assert step(CompletionOutput(0, [5], "a", "length"), CompletionOutput(1, [6, 7], "bc")) == [(1, "c", [7], None)]
    assert step(CompletionOutput(0, [5], "a", "length"), CompletionOutput(1, [6, 7], "bc", "stop")) == [
        (1, "", [], "stop")]


def test_streamed_logprob_offsets_equal_non_streamed(client):
    """A stop string holds streamed text back; the tokens' text_offset must not lag with it."""
    kwargs = dict(model=MODEL, prompt="the time of day", max_tokens=10, temperature=0, logprobs=1, stop=["zzz"])
    full = client.completions.create(**kwargs).choices[0].logprobs
    offsets, tokens = [], []
    for chunk in client.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            if c.logprobs is not None:
                offsets += c.logprobs.text_offset
                tokens += c.logprobs.tokens
    assert tokens == full.tokens and offsets == full.text_offset
