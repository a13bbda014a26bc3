"""Tenants and priorities through real HTTP: named API keys (Bearer and Anthropic's x-api-key), the `user` field,
`priority`, per-tenant metrics, and the fair and priority policies seen by real clients (the `openai` SDK,
streamed and not). Greedy outputs are checked against plain transformers."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from conftest import assert_no_leak, hf_greedy, random_prompts, tiny_model  # noqa: E402
from tiny_server import MODEL, serving, tiny_tokenizer  # noqa: E402

import paged_hf  # noqa: E402
from paged_hf.serving.openai import ServerSettings, create_app  # noqa: E402
from paged_hf.serving.openai.api_keys import named_api_keys, read_api_key_file, split_named_key  # noqa: E402

KEYS = {"alice": "key-a", "bob": "key-b"}


def start(policy: str, **settings):
    model = tiny_model("llama", dtype=torch.float32)
    generator = paged_hf.wrap(model, tiny_tokenizer(), num_blocks=256, block_size=16, max_num_seqs=4,
                              max_num_batched_tokens=64, max_model_len=512, scheduling_policy=policy).generator
    app = create_app(generator, generator.tokenizer, MODEL, ServerSettings(**settings))
    return model, generator, app


@pytest.fixture(scope="module")
def fair():
    """A fair server with two named keys: alice's on the command line, bob's from a keys file; alice's /metrics
    shows every tenant (--metrics-key alice)."""
    model, generator, app = start("fair", api_key=["alice=key-a"], api_keys={"bob": "key-b"}, metrics_keys=["alice"])
    with serving(app) as url:
        yield url, model, generator
    assert_no_leak(generator)


def client(url: str, key: str):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def metrics(url: str, key: str = KEYS["alice"]) -> dict[str, float]:
    text = httpx.get(url + "/metrics", headers={"x-api-key": key}, timeout=30).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def completion(url: str, key: str, prompt: list[int], max_tokens: int, **extra) -> httpx.Response:
    return httpx.post(url + "/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True, **extra})


def test_each_named_key_is_accepted_as_bearer_or_x_api_key_and_nothing_else(fair):
    url = fair[0]
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2}
    for headers in ({"Authorization": "Bearer key-a"}, {"x-api-key": "key-b"}, {"authorization": "bearer key-b"}):
        assert httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60).status_code == 200
    for headers in ({}, {"Authorization": "Bearer key-c"}, {"x-api-key": "key-"}, {"Authorization": "key-a"},
                    {"x-api-key": ""}):
        response = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)
        assert response.status_code == 401, headers
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/metrics").status_code == 401


@pytest.mark.parametrize("stream", [False, True])
def test_both_keys_get_transformers_greedy_tokens_streamed_and_not(fair, stream):
    url, model, generator = fair
    tokenizer = generator.tokenizer
    prompts = random_prompts([7, 11], seed=5)
    for key, prompt in zip(KEYS.values(), prompts):
        expected = tokenizer.decode(hf_greedy(model, prompt, 6), skip_special_tokens=True)
        args = dict(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
        if stream:
            text = "".join(chunk.choices[0].text for chunk in client(url, key).completions.create(stream=True, **args)
                           if chunk.choices)
        else:
            text = client(url, key).completions.create(**args).choices[0].text
        assert text == expected


def test_the_tenant_is_the_user_field_else_the_key_and_metrics_are_per_tenant(fair):
    url = fair[0]
    before = metrics(url)
    assert completion(url, "key-a", [5, 6, 7], 3).status_code == 200
    assert completion(url, "key-b", [5, 6, 7, 8], 4).status_code == 200
    assert client(url, "key-b").chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "the a"}], max_tokens=5, temperature=0,
        user="carol", extra_body={"ignore_eos": True}).usage.completion_tokens == 5
    after = metrics(url)

    def grew(name: str, tenant: str) -> float:
        key = f'{name}{{tenant="{tenant}"}}'
        return after.get(key, 0) - before.get(key, 0)

    assert grew("paged_hf_tenant_requests_total", "alice") == 1 and grew("paged_hf_tenant_requests_total", "bob") == 1
    assert grew("paged_hf_tenant_requests_total", "carol") == 1
    assert grew("paged_hf_tenant_prompt_tokens_total", "bob") == 4
    assert [grew("paged_hf_tenant_generation_tokens_total", t) for t in ("alice", "bob", "carol")] == [3, 4, 5]
    assert grew("paged_hf_tenant_queue_time_seconds_count", "carol") == 1
    assert grew("paged_hf_tenant_time_to_first_token_seconds_count", "alice") == 1
    response = completion(url, "key-a", [5, 6], 2, user="")
    assert response.status_code == 400 and "user" in response.json()["error"]["message"]


def test_a_key_without_metrics_key_sees_only_its_own_tenants_series(fair):
    url = fair[0]
    assert completion(url, "key-a", [5, 6, 7], 2, user="dave").status_code == 200
    assert completion(url, "key-b", [5, 6], 2).status_code == 200
    tenants = {name.split('tenant="')[1].split('"')[0] for name in metrics(url, "key-b")
               if name.startswith("paged_hf_tenant_requests_total")}
    assert "bob" in tenants and not tenants & {"alice", "dave"}, tenants
    everyone = {name for name in metrics(url) if name.startswith("paged_hf_tenant_requests_total")}
    assert {'paged_hf_tenant_requests_total{tenant="dave"}', 'paged_hf_tenant_requests_total{tenant="bob"}'} <= everyone


def test_priority_needs_the_priority_policy_and_an_int(fair):
    url = fair[0]
    response = completion(url, "key-a", [5, 6, 7], 2, priority=-1)
    assert response.status_code == 400 and "priority" in response.json()["error"]["message"]
    assert completion(url, "key-a", [5, 6, 7], 2, priority=0).status_code == 200
    assert completion(url, "key-a", [5, 6, 7], 2, priority="high").status_code == 400


def stream_in_thread(url: str, key: str, prompt: list[int], max_tokens: int, events: dict, name: str, **extra):
    """A streamed completion in a thread: events[name] gets 'first' and 'done' times and the text."""
    def run():
        text = ""
        for chunk in client(url, key).completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                                        temperature=0, stream=True,
                                                        extra_body={"ignore_eos": True, **extra}):
            if chunk.choices and chunk.choices[0].text:
                events[name].setdefault("first", time.monotonic())
                text += chunk.choices[0].text
        events[name].update(done=time.monotonic(), text=text)

    events[name] = {}
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def wait_for_first_tokens(events: dict, names, count: int | None = None) -> None:
    """Until `count` (default: all) of the named requests streamed a token."""
    deadline = time.monotonic() + 60
    while sum("first" in events[n] for n in names) < (count or len(names)):
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_fair_a_quiet_tenant_is_not_stuck_behind_a_flood(fair):
    """alice floods 8 long requests (4 seats); bob's one short request runs at once (it takes a seat of alice's)
    and finishes before any of alice's that were running or queued when it came (under fcfs it waits for one of
    them to finish); alice's outputs are unchanged."""
    url, model, generator = fair
    prompts = random_prompts([20] * 8 + [6], seed=9)
    events, threads = {}, []
    for i in range(8):
        threads.append(stream_in_thread(url, "key-a", prompts[i], 200, events, f"a{i}"))
    wait_for_first_tokens(events, [f"a{i}" for i in range(8)], count=4)  # every seat taken
    sent = time.monotonic()
    threads.append(stream_in_thread(url, "key-b", prompts[8], 4, events, "b"))
    for thread in threads:
        thread.join(120)
    assert events["b"]["done"] < min(events[f"a{i}"]["done"] for i in range(8) if events[f"a{i}"]["done"] > sent)
    tokenizer = generator.tokenizer
    for i in range(8):
        assert events[f"a{i}"]["text"] == tokenizer.decode(hf_greedy(model, prompts[i], 200), skip_special_tokens=True)


def test_priority_an_urgent_request_preempts_a_full_batch_and_the_preempted_finish_unchanged():
    model, generator, app = start("priority")
    prompts = random_prompts([30] * 4 + [8], seed=11)
    tokenizer = generator.tokenizer
    with serving(app) as url:
        events: dict = {}
        threads = [stream_in_thread(url, "none", prompts[i], 150, events, f"bulk{i}") for i in range(4)]
        wait_for_first_tokens(events, [f"bulk{i}" for i in range(4)])  # 4 seats: every one running
        urgent = completion(url, "none", prompts[4], 3, priority=-1)
        finished_urgent = time.monotonic()
        for thread in threads:
            thread.join(120)
        assert urgent.status_code == 200
        assert urgent.json()["choices"][0]["text"] == tokenizer.decode(hf_greedy(model, prompts[4], 3),
                                                                       skip_special_tokens=True)
        assert all(finished_urgent < events[f"bulk{i}"]["done"] for i in range(4))
        assert metrics_preemptions(url) >= 1
        for i in range(4):
            assert events[f"bulk{i}"]["text"] == tokenizer.decode(hf_greedy(model, prompts[i], 150),
                                                                  skip_special_tokens=True)
    assert_no_leak(generator)


def metrics_preemptions(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith("paged_hf_num_preemptions")))


def test_key_names_and_files(tmp_path):
    assert split_named_key("bob=s3cret") == ("bob", "s3cret")
    assert split_named_key("c2VjcmV0==") == (None, "c2VjcmV0==")  # base64 padding: a plain key
    assert split_named_key("plain") == (None, "plain")
    assert named_api_keys(["k1", "ops=k2", "k3"]) == {"key1": "k1", "ops": "k2", "key3": "k3"}
    assert ServerSettings(api_key=["only"]).api_key == "only"
    for bad in (["a=x", "a=y"], ["x", "x"], ["  "]):
        with pytest.raises(ValueError):
            named_api_keys(bad)
    lines = tmp_path / "keys.txt"
    lines.write_text("# tenants\nalice=key=with=equals\n\nbob = key-b\n")
    assert read_api_key_file(str(lines)) == {"alice": "key=with=equals", "bob": "key-b"}
    as_json = tmp_path / "keys.json"
    as_json.write_text('{"alice": "key-a"}')
    assert read_api_key_file(str(as_json)) == {"alice": "key-a"}
    as_json.write_text("nonsense")
    with pytest.raises(ValueError, match="line 1"):
        read_api_key_file(str(as_json))


def test_serve_flags_for_keys_and_policy(tmp_path):
    from paged_hf.entrypoints import cli
    from paged_hf.entrypoints.cli_args import engine_config
    from paged_hf.serving.assembly import serve_settings

    keys = tmp_path / "keys.txt"
    keys.write_text("bob=key-b\n")
    args = cli.build_parser().parse_args(["serve", "--api-key", "key-a", "--api-key", "ops=key-o", "--api-key-file",
                                          str(keys), "--scheduling-policy", "fair", "--tenant-weight", "bob=2",
                                          "--generation-config", "vllm"])
    assert engine_config(args) == {"scheduling_policy": "fair", "tenant_weights": {"bob": 2.0}}
    settings = serve_settings(args, None)
    assert settings.named_keys == {"key1": "key-a", "ops": "key-o", "bob": "key-b"}
    with pytest.raises(ValueError, match="tenant-weight"):
        engine_config(cli.build_parser().parse_args(["serve", "--tenant-weight", "bob=0"]))
