"""Disaggregated prefill and decode between real `paged-hf serve` processes (float32 tiny Llama, block size 16):
a producer computes the prompt (max_tokens=1) and answers with `kv_transfer_params`; a consumer given them pulls
the blocks over HTTP (its own folder) or indexes them where they lie (the producer's folder), computes at most
one block of the prompt, and answers with the tokens one instance gives. Faults (a truncated or overwritten
block file, another model's params, the producer gone) cost recomputation, never a wrong token or a hang."""

from __future__ import annotations

import json
import os
import random

import httpx
import pytest
from transformers import AutoModelForCausalLM

pytest.importorskip("fastapi")

from conftest import make_adapter  # noqa: E402
from serve_process import MODEL, ServerProcess, save_tiny_model  # noqa: E402
from tiny_server import serving  # noqa: E402

from paged_hf.serving.proxy import ProxySettings, create_proxy_app  # noqa: E402

BLOCK = 16
FLAGS = ("--max-num-batched-tokens", "48")  # a 200-token prompt is computed in several chunks


def transfer_config(role: str) -> str:
    return json.dumps({"kv_connector": "PagedHFConnector", "kv_role": role})


@pytest.fixture(scope="module")
def instances(tmp_path_factory):
    """(producer, consumer pulling over HTTP, consumer sharing the producer's folder, the producer's folder)."""
    root = tmp_path_factory.mktemp("disagg")
    folder = save_tiny_model(root / "model")
    make_adapter(AutoModelForCausalLM.from_pretrained(folder), root / "adapter", seed=1, r=4, lora_alpha=8,
                 target_modules=["q_proj", "v_proj"])
    shared = str(root / "shared")
    adapter = ("--adapter", f"ad={root / 'adapter'}")
    with ServerProcess(folder, *FLAGS, *adapter, "--kv-cache-dir", shared, "--kv-transfer-config",
                       transfer_config("kv_producer")) as producer, \
         ServerProcess(folder, *FLAGS, *adapter, "--kv-transfer-config", transfer_config("kv_consumer")) as pulling, \
         ServerProcess(folder, *FLAGS, *adapter, "--kv-cache-dir", shared, "--kv-transfer-config",
                       transfer_config("kv_consumer")) as sharing:
        yield producer, pulling, sharing, shared


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(7, 128) for _ in range(length)]


def post(url: str, body: dict, route: str = "/v1/completions") -> dict:
    response = httpx.post(url + route, json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def request(ids, chat: bool, **fields) -> dict:
    body = {"model": fields.pop("model", MODEL), "temperature": 0, "ignore_eos": True, **fields}
    if chat:
        return {**body, "messages": [{"role": "user", "content": " ".join(map(str, ids))}]}
    return {**body, "prompt": ids}


def answer_text(answer: dict) -> str:
    choice = answer["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def disaggregated(producer, consumer, ids, chat: bool = False, **fields) -> tuple[dict, dict]:
    """(the producer's params, the consumer's answer) of one request through both."""
    route = "/v1/chat/completions" if chat else "/v1/completions"
    first = post(producer.url, request(ids, chat, max_tokens=1, kv_transfer_params={"do_remote_decode": True},
                                       **fields), route)
    params = first["kv_transfer_params"]
    answer = post(consumer.url, request(ids, chat, max_tokens=6, kv_transfer_params=params, **fields), route)
    return params, answer


def reference(producer, ids, chat: bool = False, **fields) -> str:
    """One instance's greedy answer: the producer, under a salt of its own (no cache hit from the runs above)."""
    route = "/v1/chat/completions" if chat else "/v1/completions"
    salt = f"reference-{random.random()}"
    return answer_text(post(producer.url, request(ids, chat, max_tokens=6, cache_salt=salt, **fields), route))


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in /metrics")


@pytest.mark.parametrize("length", [10, 2 * BLOCK, 2 * BLOCK + 1, 200])
def test_consumers_answer_as_one_instance_and_compute_at_most_one_block(instances, length):
    producer, pulling, sharing, _ = instances
    ids = prompt(length, length)
    expected = reference(producer, ids)
    for seed, consumer in enumerate((pulling, sharing)):
        ids_here = ids if seed == 0 else prompt(1000 + length, length)  # the sharing consumer: its own prompt
        want = expected if seed == 0 else reference(producer, ids_here)
        params, answer = disaggregated(producer, consumer, ids_here)
        assert len(params["block_keys"]) == length // BLOCK and params["num_tokens"] == length // BLOCK * BLOCK
        assert answer_text(answer) == want
        cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == (length - 1) // BLOCK * BLOCK and length - cached <= BLOCK  # at most one block computed
    assert metric(pulling.url, "paged_hf_kv_transfer_received_blocks_total") >= (length >= BLOCK)
    assert metric(producer.url, "paged_hf_kv_transfer_sent_requests_total") >= 2


def test_chat_and_an_adapter_transfer_too(instances):
    producer, pulling, _, _ = instances
    ids = prompt(7, 60)
    for fields in ({}, {"model": "ad"}):
        params, answer = disaggregated(producer, pulling, ids, chat=True, **fields)
        assert answer_text(answer) == reference(producer, ids, chat=True, **fields)
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(params["block_keys"]) * BLOCK - BLOCK
    base = disaggregated(producer, pulling, prompt(8, 64))[0]["block_keys"]
    adapted = disaggregated(producer, pulling, prompt(8, 64), model="ad")[0]["block_keys"]
    salted, answer = disaggregated(producer, pulling, prompt(8, 64), cache_salt="tenant-a")
    assert answer_text(answer) == reference(producer, prompt(8, 64))
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * BLOCK  # its own blocks, transferred
    # the adapter and the salt are in every key: their K/V is never the base model's or another salt's
    assert not set(base) & set(adapted) and not set(base) & set(salted["block_keys"])


def streamed(url: str, body: dict, route: str) -> tuple[str, dict]:
    """(the streamed text, the usage chunk) of one streamed request."""
    text, usage = "", None
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + route, json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text, usage


def test_through_the_proxy_greedy_answers_equal_one_instance(instances):
    """The proxy sends each prompt of at least a block through the producer; the consumer's answer, streamed or
    not, completion or chat, base model or adapter, is one instance's, and it computed at most one block."""
    producer, pulling, _, _ = instances
    settings = ProxySettings((producer.url,), (pulling.url,), prefill_threshold_tokens=BLOCK)
    with serving(create_proxy_app(settings)) as url:
        for seed, (chat, stream, fields) in enumerate([(False, False, {}), (False, True, {}), (True, False, {}),
                                                       (True, True, {"model": "ad"})]):
            ids = prompt(50 + seed, 3 * BLOCK + seed)
            route = "/v1/chat/completions" if chat else "/v1/completions"
            body = request(ids, chat, max_tokens=6, **fields)
            if stream:
                text, usage = streamed(url, body, route)
            else:
                answer = post(url, body, route)
                text, usage = answer_text(answer), answer["usage"]
            assert text == reference(producer, ids, chat, **fields)
            assert usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"] <= BLOCK
        transfers = httpx.get(url + "/metrics", timeout=30).text
        assert "paged_hf_proxy_transfers_total 4" in transfers


def test_bad_block_files_and_foreign_params_are_recomputed(instances):
    producer, pulling, sharing, shared = instances
    for consumer, seed, damaged in ((pulling, 21, 1), (sharing, 23, 3)):  # truncated / overwritten: a miss there
        ids = prompt(seed, 5 * BLOCK)
        params = post(producer.url, request(ids, False, max_tokens=1))["kv_transfer_params"]
        path = os.path.join(shared, f"{params['block_keys'][damaged]}.safetensors")
        with open(path, "r+b") as f:
            if consumer is pulling:
                f.truncate(os.path.getsize(path) // 2)
            else:
                f.seek(-64, os.SEEK_END)
                f.write(os.urandom(64))
        counter = "paged_hf_kv_transfer_rejected_blocks_total" if consumer is pulling else "paged_hf_kv_tier_bad_files_total"
        before = metric(consumer.url, counter)
        answer = post(consumer.url, request(ids, False, max_tokens=6, kv_transfer_params=params))
        assert answer_text(answer) == reference(producer, ids)
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == damaged * BLOCK  # up to the bad block
        assert metric(consumer.url, counter) == before + 1
    other = prompt(22, 4 * BLOCK)
    params = post(producer.url, request(other, False, max_tokens=1))["kv_transfer_params"]
    answer = post(pulling.url, request(other, False, max_tokens=6, kv_transfer_params={**params, "namespace": "0" * 32}))
    assert answer_text(answer) == reference(producer, other)
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert metric(pulling.url, "paged_hf_kv_transfer_foreign_requests_total") >= 1
    bad = {**params, "block_keys": ["not hex"]}
    response = httpx.post(pulling.url + "/v1/completions", json=request(other, False, kv_transfer_params=bad))
    assert response.status_code == 400 and "block_keys" in response.json()["error"]["message"]


def test_a_producer_gone_costs_recomputation(instances):
    producer, pulling, _, _ = instances
    ids = prompt(31, 6 * BLOCK)
    expected = reference(producer, ids)
    params = post(producer.url, request(ids, False, max_tokens=1))["kv_transfer_params"]
    producer.process.kill()
    producer.process.wait(30)
    failed = metric(pulling.url, "paged_hf_kv_transfer_failed_pulls_total")
    answer = post(pulling.url, request(ids, False, max_tokens=6, kv_transfer_params=params))
    assert answer_text(answer) == expected and answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert metric(pulling.url, "paged_hf_kv_transfer_failed_pulls_total") == failed + 1


@pytest.mark.parametrize("value, message", [
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}', "kv_connector must be 'PagedHFConnector'"),
    ({"kv_role": "producer"}, "kv_role must be one of kv_producer, kv_consumer, kv_both"),
    ({"kv_role": "kv_both", "kv_buffer_size": 1}, "unknown kv_transfer_config field(s) ['kv_buffer_size']"),
    ({"kv_connector_extra_config": {"shared_dir": "/x"}}, "kv_connector_extra_config takes url, api_key, timeout_s"),
    ("{not json", "kv_transfer_config is not valid JSON"),
])
def test_a_bad_kv_transfer_config_is_refused_naming_what_is_wrong(value, message):
    from paged_hf.config import KVTransferConfig  # noqa: PLC0415

    with pytest.raises(ValueError) as error:
        KVTransferConfig.parse(value)
    assert message in str(error.value)
