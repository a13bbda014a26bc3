"""Issue 49's isolation beyond the Responses API (that one is in test_hostile_requests.py): stored records'
owners across a restart, adapters a key loads at run time, /metrics labels, prefix-cache hits under
--prefix-cache-isolation key, and the single-key server that keeps today's behaviour. A tiny word-level
Llama; adapters are checked against peft's own output."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("peft")

from conftest import assert_no_leak, hf_greedy, make_adapter, tiny_model  # noqa: E402
from tiny_server import serving, tiny_tokenizer  # noqa: E402

import paged_hf  # noqa: E402
from paged_hf.serving.openai import ServerSettings, create_app  # noqa: E402
from paged_hf.serving.openai.responses_store import ResponseStore  # noqa: E402

KEYS = {"alice": "key-a", "bob": "key-b", "ops": "key-o"}
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
PROMPT = [5, 6, 7, 8, 9]


def post(url: str, path: str, body: dict, key: str) -> httpx.Response:
    return httpx.post(url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def completion(url: str, key: str, model: str, prompt=PROMPT, max_tokens: int = 4) -> httpx.Response:
    return post(url, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                         "temperature": 0}, key)


def metrics(url: str, key: str) -> str:
    return httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=30).text


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    """Three named keys (ops reads every tenant's metrics), a LoRA root with two adapters."""
    root = tmp_path_factory.mktemp("loras")
    base = tiny_model("llama", dtype=torch.float32)
    oracles = {name: make_adapter(base, root / name, seed=seed, **LORA) for name, seed in (("a", 1), ("b", 2))}
    generator = paged_hf.wrap(base, tiny_tokenizer(), num_blocks=64, max_model_len=128, lora_root=str(root)).generator
    settings = ServerSettings(api_key=[f"{name}={key}" for name, key in KEYS.items()], metrics_keys=("ops",))
    with serving(create_app(generator, generator.tokenizer, "tiny", settings)) as url:
        yield url, oracles
    assert_no_leak(generator)


def test_an_adapter_a_key_loads_is_that_keys_alone(lora_server):
    url, oracles = lora_server
    alice, bob = KEYS["alice"], KEYS["bob"]
    assert post(url, "/v1/load_lora_adapter", {"lora_name": "mine", "lora_path": "a"}, alice).status_code == 200
    models = {key: [card["id"] for card in httpx.get(url + "/v1/models", headers={"x-api-key": key}).json()["data"]]
              for key in (alice, bob)}
    assert "mine" in models[alice] and "mine" not in models[bob]
    unknown = completion(url, bob, "nothing-here")
    for name in ("mine", "mine@alice"):  # bob meets alice's adapter exactly as a name nobody served
        refused = completion(url, bob, name)
        assert refused.status_code == 404 and refused.text.replace(name, "nothing-here") == unknown.text
    assert post(url, "/v1/unload_lora_adapter", {"lora_name": "mine"}, bob).status_code == 404
    assert post(url, "/v1/load_lora_adapter", {"lora_name": "mine", "lora_path": "b"}, bob).status_code == 200
    for key, adapter in ((alice, "a"), (bob, "b")):  # two adapters under one name, each key's own weights
        expected = tiny_tokenizer().decode(hf_greedy(oracles[adapter], PROMPT, 4), skip_special_tokens=True)
        assert completion(url, key, "mine").json()["choices"][0]["text"] == expected
    assert "mine@alice" not in metrics(url, bob) and "mine@bob" in metrics(url, bob)
    assert "mine@alice" in metrics(url, KEYS["ops"])
    refused = post(url, "/v1/load_lora_adapter", {"lora_name": "x@y", "lora_path": "a"}, bob)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "lora_name"
    for key in (alice, bob):
        assert post(url, "/v1/unload_lora_adapter", {"lora_name": "mine"}, key).status_code == 200
    assert completion(url, alice, "mine").status_code == 404


@pytest.mark.parametrize("isolation", ["none", "key"])
def test_prefix_cache_hits_stay_within_a_key_under_isolation(isolation):
    base = tiny_model("llama", dtype=torch.float32)
    generator = paged_hf.wrap(base, tiny_tokenizer(), num_blocks=64, block_size=4, max_model_len=128).generator
    settings = ServerSettings(api_key=[f"{name}={key}" for name, key in KEYS.items()],
                              prefix_cache_isolation=isolation)
    prompt = list(range(5, 30))  # 25 tokens: 6 full blocks

    def hits() -> float:
        line = next(line for line in metrics(url, KEYS["ops"]).splitlines()
                    if line.startswith("paged_hf_prefix_cache_hits_total"))
        return float(line.split()[-1])

    with serving(create_app(generator, generator.tokenizer, "tiny", settings)) as url:
        texts = {}
        for key in ("alice", "bob", "alice"):
            before = hits()
            texts.setdefault(key, []).append(completion(url, KEYS[key], "tiny", prompt, 3).json()["choices"][0]["text"])
            texts.setdefault(key + " hits", []).append(hits() - before)
    assert texts["alice"][0] == texts["alice"][1] == texts["bob"][0]  # the salt changes hits, never tokens
    assert texts["alice hits"] == [0, 24]  # a key's own second request finds its blocks
    assert texts["bob hits"] == ([0] if isolation == "key" else [24])
    assert_no_leak(generator)


def test_store_records_keep_their_owner_across_a_restart(tmp_path):
    ids = [f"resp_{i:032x}" for i in range(3)]
    (tmp_path / f"{ids[2]}.json").write_text(json.dumps({"response": {"id": ids[2]}}))  # an older version's file
    store = ResponseStore(max_count=10, directory=str(tmp_path))
    store.put(ids[0], {"response": {"id": ids[0]}}, owner="alice")
    store.put(ids[1], {"response": {"id": ids[1]}})  # a single-tenant server's: no owner
    for reopened in (store, ResponseStore(max_count=10, directory=str(tmp_path))):
        assert reopened.get(ids[0], "alice") == {"response": {"id": ids[0]}}
        assert reopened.get(ids[0], "bob") is None and reopened.get(ids[0]) is None
        for unowned in ids[1:]:  # no owner: the single-tenant server's alone
            assert reopened.get(unowned) is not None and reopened.get(unowned, "alice") is None
        assert not reopened.delete(ids[0], "bob") and reopened.get(ids[0], "alice") is not None


def test_a_flood_evicts_the_flooders_own_records_first():
    store = ResponseStore(max_count=10, max_bytes=1 << 20)
    mine = [f"resp_{i:032x}" for i in range(3)]
    for response_id in mine:
        store.put(response_id, {"response": {}}, owner="alice")
    for i in range(100):
        store.put(f"resp_{1000 + i:032x}", {"response": {}}, owner="bob")
        assert len(store) <= 10
    assert all(store.get(response_id, "alice") is not None for response_id in mine)
    big = ResponseStore(max_count=100, max_bytes=2_000)
    big.put(mine[0], {"text": "a" * 100}, owner="alice")
    for i in range(50):
        big.put(f"resp_{1000 + i:032x}", {"text": "b" * 300}, owner="bob")
        assert big.num_bytes <= 2_000
    assert big.get(mine[0], "alice") is not None


def test_settings_that_cannot_isolate_are_refused():
    with pytest.raises(ValueError, match="prefix-cache-isolation key needs API keys"):
        ServerSettings(prefix_cache_isolation="key")
    with pytest.raises(ValueError, match="prefix-cache-isolation"):
        ServerSettings(api_key="a=b", prefix_cache_isolation="tenant")
    with pytest.raises(ValueError, match="--metrics-key carol"):
        ServerSettings(api_key=["alice=k1", "bob=k2"], metrics_keys=["carol"])
    assert not ServerSettings().tenant_isolation and not ServerSettings(api_key="plain").tenant_isolation
    assert ServerSettings(api_key="alice=k1").tenant_isolation and ServerSettings(api_key=["k1", "k2"]).tenant_isolation


def test_serve_flags_for_isolation_and_limits():
    from paged_hf.entrypoints import cli
    from paged_hf.serving.assembly import serve_settings

    args = cli.build_parser().parse_args([
        "serve", "--api-key", "alice=k1", "--api-key", "ops=k2", "--prefix-cache-isolation", "key",
        "--metrics-key", "ops", "--max-json-depth", "64", "--max-request-items", "100",
        "--max-embedding-inputs", "10", "--max-detokenize-tokens", "1000", "--generation-config", "vllm"])
    settings = serve_settings(args, None)
    assert (settings.prefix_cache_isolation, settings.metrics_keys) == ("key", ("ops",))
    assert (settings.max_json_depth, settings.max_request_items, settings.max_embedding_inputs,
            settings.max_detokenize_tokens) == (64, 100, 10, 1000)
