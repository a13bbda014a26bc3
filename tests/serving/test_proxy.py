"""`paged-hf proxy` end to end: real HTTP everywhere. Two real paged_hf servers in this process (a "prefill" and a
"decode" instance, one tiny model), the proxy in front of them, the `openai` client and httpx as its clients.

The servers run without a KV connector: a `Connector` stand-in in front of each records what the proxy sent and
passes it on without `kv_transfer_params` (what the servers do with them is tests/serving/test_disaggregated.py's
business); on the prefill it can answer transfer parameters, as a producer would. Nothing is transferred, so
decode computes the prompt itself: the same tokens.
"""

from __future__ import annotations

import contextlib
import copy
import json
import random
import time

import httpx
import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from conftest import assert_no_leak, tiny_model  # noqa: E402
from tiny_server import API_KEY, MODEL, WORDS, free_port, serving, tiny_tokenizer  # noqa: E402

import paged_hf  # noqa: E402
from paged_hf.serving.openai import ServerSettings, create_app  # noqa: E402
from paged_hf.serving.proxy import ProxySettings, create_proxy_app  # noqa: E402
from paged_hf.serving.proxy.routing import TransferredPrompts, prefill_body  # noqa: E402

AUTH = {"Authorization": f"Bearer {API_KEY}"}
THRESHOLD = 16  # prompt tokens: fewer go straight to decode
GREEDY = {"temperature": 0, "ignore_eos": True, "max_tokens": 6}


class Connector:
    """ASGI, in front of one instance: records the JSON bodies it is sent, passes them on without
    `kv_transfer_params`, and with `params` set adds them to the answer of a request that asked for a remote
    decode (a non-streamed JSON answer: a prefill's)."""

    def __init__(self, app):
        self.app, self.bodies, self.params = app, [], None

    def sent(self, path: str) -> list[dict]:
        return [body for p, body in self.bodies if p == path]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        raw, more = b"", True
        while more:
            message = await receive()
            raw, more = raw + message.get("body", b""), message.get("more_body", False)
        body = json.loads(raw)
        self.bodies.append((scope["path"], copy.deepcopy(body)))
        asked = body.pop("kv_transfer_params", None) or {}
        raw = json.dumps(body).encode()
        headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"] + [(b"content-length",
                                                                                      str(len(raw)).encode())]
        replayed = [{"type": "http.request", "body": raw, "more_body": False}]

        async def replay():
            return replayed.pop() if replayed else await receive()

        if asked.get("do_remote_decode") and self.params is not None:
            send = _with_params(send, self.params)
        await self.app({**scope, "headers": headers}, replay, send)


def _with_params(send, params: dict):
    """`send` for a JSON answer, with `kv_transfer_params` added to it."""
    start, chunks = None, []

    async def patched(message):
        nonlocal start
        if message["type"] == "http.response.start":
            start = message
            return
        chunks.append(message.get("body", b""))
        if message.get("more_body"):
            return
        body = json.loads(b"".join(chunks))
        raw = json.dumps({**body, "kv_transfer_params": params}).encode()
        headers = [(k, v) for k, v in start["headers"] if k != b"content-length"]
        await send({**start, "headers": headers + [(b"content-length", str(len(raw)).encode())]})
        await send({"type": "http.response.body", "body": raw, "more_body": False})

    return patched


class Instance(Connector):
    """One server (the ASGI app to serve) and its URL once served."""

    def __init__(self, model):
        self.generator = paged_hf.wrap(model, tiny_tokenizer(), num_blocks=128, block_size=16, max_num_seqs=8,
                                       max_num_batched_tokens=256, max_model_len=512).generator
        settings = ServerSettings(api_key=API_KEY, max_queue=64)
        super().__init__(create_app(self.generator, self.generator.tokenizer, MODEL, settings))
        self.url = ""


@pytest.fixture(scope="module")
def instances():
    """(prefill, decode): two servers of one tiny model."""
    model = tiny_model("llama", dtype=torch.float32)
    prefill, decode = Instance(model), Instance(copy.deepcopy(model))
    with serving(prefill) as prefill.url, serving(decode) as decode.url:
        yield prefill, decode
    assert_no_leak(prefill.generator)
    assert_no_leak(decode.generator)


@contextlib.contextmanager
def proxy_for(prefill_urls, decode_urls, **settings):
    settings.setdefault("prefill_threshold_tokens", THRESHOLD)
    app = create_proxy_app(ProxySettings(tuple(prefill_urls), tuple(decode_urls), **settings))
    with serving(app) as url:
        yield url


@pytest.fixture(scope="module")
def proxy(instances):
    prefill, decode = instances
    with proxy_for([prefill.url], [decode.url]) as url:
        yield url


def words(n: int, seed: int) -> str:
    """A prompt of `n` words of the tiny vocabulary, different for each seed (so not yet transferred)."""
    return " ".join(random.Random(seed).choice(WORDS) for _ in range(n))


def post(url: str, path: str, body: dict, headers=AUTH) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=headers, timeout=60)


def proxy_metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", headers=AUTH, timeout=30).text
    lines = [line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#")]
    return {name.removeprefix("paged_hf_proxy_"): float(value) for name, value in lines}


def path_taken(url: str, before: dict) -> str:
    after = proxy_metrics(url)
    taken = [path for path in ("direct", "disaggregated")
             if after[f'requests_total{{path="{path}"}}'] > before[f'requests_total{{path="{path}"}}']]
    assert len(taken) == 1, (before, after)
    return taken[0]


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.mark.parametrize("kind", ["text", "token_ids"])
def test_long_completion_goes_through_prefill_with_decode_s_answer(instances, proxy, kind):
    prefill, decode = instances
    prompt = words(40, seed=1) if kind == "text" else random.Random(2).choices(range(7, 120), k=40)
    body = {"model": MODEL, "prompt": prompt, **GREEDY}
    expected = post(decode.url, "/v1/completions", body).json()["choices"][0]["text"]
    before, num_prefills = proxy_metrics(proxy), len(prefill.sent("/v1/completions"))
    answer = post(proxy, "/v1/completions", body)
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == expected
    assert path_taken(proxy, before) == "disaggregated"
    sent = prefill.sent("/v1/completions")[num_prefills:]
    asked = {"max_tokens": 1, "stream": False, "n": 1, "kv_transfer_params": {"do_remote_decode": True}}
    assert sent == [{**body, **asked}]
    assert decode.sent("/v1/completions")[-1] == body  # nothing transferred: the client's body as it was
    before = proxy_metrics(proxy)  # the same prompt again: decode has its blocks
    streamed = client(proxy).completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True})
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == expected
    assert path_taken(proxy, before) == "direct"
    assert len(prefill.sent("/v1/completions")) == num_prefills + 1


@pytest.mark.parametrize("stream", [False, True])
def test_chat_through_prefill_equals_decode_s_answer(instances, proxy, stream):
    prefill, decode = instances
    messages = [{"role": "system", "content": words(12, seed=3 + stream)},
                {"role": "user", "content": words(20, seed=5 + stream)}]
    direct = client(decode.url).chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    before, num_prefills = proxy_metrics(proxy), len(prefill.sent("/v1/chat/completions"))
    answer = client(proxy).chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                                   stream=stream, stream_options={"include_usage": True} if stream
                                                   else None)
    if stream:
        text = "".join(chunk.choices[0].delta.content or "" for chunk in answer if chunk.choices)
    else:
        text = answer.choices[0].message.content
    assert text == direct.choices[0].message.content
    assert path_taken(proxy, before) == "disaggregated"
    sent = prefill.sent("/v1/chat/completions")[num_prefills:]
    assert len(sent) == 1 and sent[0]["max_tokens"] == 1 and sent[0]["stream"] is False
    assert "stream_options" not in sent[0] and sent[0]["kv_transfer_params"] == {"do_remote_decode": True}


def test_short_prompts_and_batches_go_straight_to_decode(instances, proxy):
    prefill, decode = instances
    num_prefills = len(prefill.bodies)
    for prompt in (words(4, seed=7), [words(30, seed=8), words(30, seed=9)]):
        before = proxy_metrics(proxy)
        answer = post(proxy, "/v1/completions", {"model": MODEL, "prompt": prompt, **GREEDY})
        assert answer.status_code == 200 and len(answer.json()["choices"]) == (1 if isinstance(prompt, str) else 2)
        assert path_taken(proxy, before) == "direct"
    assert len(prefill.bodies) == num_prefills


def in_flight(instance: Instance) -> float:
    text = httpx.get(instance.url + "/metrics", headers=AUTH, timeout=30).text
    return float(next(line for line in text.splitlines() if line.startswith("paged_hf_num_requests_in_flight "))
                 .split()[1])


def test_stream_passes_through_as_it_comes_and_a_leaving_client_ends_decode_s_request(instances, proxy):
    _, decode = instances
    body = {"model": MODEL, "prompt": words(30, seed=16), **GREEDY, "max_tokens": 400, "stream": True}
    with httpx.stream("POST", proxy + "/v1/completions", json=body, headers=AUTH, timeout=60) as answer:
        chunks = answer.iter_raw()  # kept: a dropped iterator closes the connection
        assert answer.status_code == 200 and next(chunks).startswith(b"data: ")
        assert in_flight(decode) == 1  # the first chunk came while decode was still generating
    deadline = time.monotonic() + 10
    while in_flight(decode):
        assert time.monotonic() < deadline, "decode kept generating for a client that had left"
        time.sleep(0.05)


def test_n_above_one_prefills_once(instances, proxy):
    prefill, _ = instances
    body = {"model": MODEL, "prompt": words(30, seed=10), "n": 2, "temperature": 1.0, "seed": 3, "max_tokens": 4}
    answer = post(proxy, "/v1/completions", body)
    assert answer.status_code == 200 and len(answer.json()["choices"]) == 2
    assert prefill.sent("/v1/completions")[-1]["n"] == 1


def test_transfer_params_reach_decode_and_are_counted(instances, proxy):
    prefill, decode = instances
    params = {"num_tokens": 31, "num_bytes": 4096, "remote_blocks": ["opaque", 1]}
    prefill.params = params
    try:
        before = proxy_metrics(proxy)
        body = {"model": MODEL, "prompt": words(30, seed=11), **GREEDY}
        assert post(proxy, "/v1/completions", body).status_code == 200
    finally:
        prefill.params = None
    assert decode.sent("/v1/completions")[-1] == {**body, "kv_transfer_params": params}
    after = proxy_metrics(proxy)
    for name, delta in (("transfers_total", 1), ("transfer_tokens_total", 31), ("transfer_bytes_total", 4096)):
        assert after[name] - before[name] == delta


def test_prefill_s_client_error_is_relayed(instances, proxy):
    _, decode = instances
    num_decodes = len(decode.sent("/v1/completions"))
    answer = post(proxy, "/v1/completions", {"model": "no-such-model", "prompt": words(30, seed=12), **GREEDY})
    assert answer.status_code == 404 and answer.json()["error"]["message"]
    assert len(decode.sent("/v1/completions")) == num_decodes


def test_dead_prefill_recomputes_or_fails(instances):
    _, decode = instances
    dead = f"http://127.0.0.1:{free_port()}"
    body = {"model": MODEL, "prompt": words(30, seed=13), **GREEDY}
    expected = post(decode.url, "/v1/completions", body).json()["choices"][0]["text"]
    with proxy_for([dead], [decode.url]) as url:
        answer = post(url, "/v1/completions", body)
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == expected
        metrics = proxy_metrics(url)
        assert metrics["fallbacks_total"] == 1 and metrics["prefill_failures_total"] == 1
        assert "kv_transfer_params" not in decode.sent("/v1/completions")[-1]
    with proxy_for([dead], [decode.url], on_prefill_failure="fail") as url:
        answer = post(url, "/v1/completions", body)
        assert answer.status_code == 503 and answer.json()["error"]["type"] == "prefill_unavailable"
        assert proxy_metrics(url)["fallbacks_total"] == 0


def test_without_prefill_instances_it_balances_over_the_decode_ones(instances):
    """No --prefill: a round-robin balancer (the replicas `bench --serve --disaggregated` compares against)."""
    first, second = instances
    body = {"model": MODEL, "prompt": words(30, seed=15), **GREEDY}
    expected = post(second.url, "/v1/completions", body).json()["choices"][0]["text"]
    sent = [len(first.sent("/v1/completions")), len(second.sent("/v1/completions"))]
    with proxy_for([], [first.url, second.url]) as url:
        texts = [post(url, "/v1/completions", {**body, "prompt": words(30, seed=16 + i)}) for i in range(2)]
        assert all(answer.status_code == 200 for answer in texts)
        assert post(url, "/v1/completions", body).json()["choices"][0]["text"] == expected
        assert proxy_metrics(url)['requests_total{path="direct"}'] == 3
    assert len(first.sent("/v1/completions")) - sent[0] >= 1 and len(second.sent("/v1/completions")) - sent[1] >= 1


def test_dead_decode_is_a_quick_503(instances):
    prefill, _ = instances
    with proxy_for([prefill.url], [f"http://127.0.0.1:{free_port()}"]) as url:
        for prompt in (words(30, seed=14), list(range(7, 47))):  # decode's /tokenize refused; after a prefill
            start = time.monotonic()
            answer = post(url, "/v1/completions", {"model": MODEL, "prompt": prompt, **GREEDY, "stream": True})
            assert answer.status_code == 503 and answer.json()["error"]["type"] == "decode_unavailable"
            assert time.monotonic() - start < 5
        assert httpx.get(url + "/health", timeout=30).status_code == 503


def test_api_key_body_checks_health_and_models(instances):
    prefill, decode = instances
    with proxy_for([prefill.url], [decode.url], api_key=API_KEY, max_body_bytes=1000) as url:
        for content, status in ((b"{nope", 400), (b"[" * 600 + b"]" * 600, 413), (b"[1]", 400)):
            answer = httpx.post(url + "/v1/completions", content=content, headers=AUTH, timeout=30)
            assert answer.status_code == status and answer.json()["error"]["code"] == status
        assert httpx.get(url + "/health", timeout=30).status_code == 200  # no key needed
        for path in ("/v1/models", "/metrics"):
            assert httpx.get(url + path, headers={"Authorization": "Bearer wrong"}, timeout=30).status_code == 401
        refused = post(url, "/v1/completions", {"model": MODEL, "prompt": "the"}, headers={})
        assert refused.status_code == 401 and refused.json()["error"]["code"] == 401
        assert [model.id for model in client(url).models.list().data] == [MODEL]


def test_routing_rules_alone():
    remembered = TransferredPrompts(capacity=2)
    for key in ("a", "b", "c"):
        remembered.remember(key, f"http://{key}")
    assert remembered.get("a") is None and remembered.get("b") == "http://b"
    chat = prefill_body({"messages": [], "max_completion_tokens": 50, "min_tokens": 9, "stream": True,
                         "stream_options": {"include_usage": True}, "n": 3}, chat=True)
    assert chat == {"messages": [], "max_completion_tokens": 1, "max_tokens": 1, "stream": False, "n": 1,
                    "kv_transfer_params": {"do_remote_decode": True}}


def test_cli_refuses_bad_urls_in_one_line(capsys):
    from paged_hf.entrypoints.cli import main  # noqa: PLC0415 - the whole CLI: only this test needs it

    assert main(["proxy", "--prefill", "localhost:8100", "--decode", "http://127.0.0.1:8200"]) == 2
    assert "prefill_urls must be http:// or https:// URLs" in capsys.readouterr().err
    assert main(["proxy", "--decode", "localhost:8200"]) == 2
    assert "decode_urls: one or more" in capsys.readouterr().err
