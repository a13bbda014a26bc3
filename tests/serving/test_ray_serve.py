"""`paged-hf serve --replicas 2` on Ray Serve (a small local Ray in this process): two engine replicas of a tiny
model behind one ingress.

Every request is answered (API key, streaming unchanged); on 4 shared system prompts x 16 questions the
prefix-aware router reaches a higher prefix-cache hit rate than round robin (read from the replicas' own
metrics); requests for an adapter loaded at runtime land on the replica that loaded it."""

from __future__ import annotations

import json
import random
import re
import time

import httpx
import pytest

pytest.importorskip("ray", reason="the test extra installs ray[serve]")
from conftest import make_adapter  # noqa: E402
from ray import serve  # noqa: E402
from serve_process import MODEL, free_port, save_tiny_model  # noqa: E402
from tiny_server import WORDS  # noqa: E402

from paged_hf.entrypoints.cli import build_parser  # noqa: E402
from paged_hf.entrypoints.cli_args import engine_config, resolve_model_args  # noqa: E402
from paged_hf.serving.ray.ingress import REPLICA_HEADER  # noqa: E402
from paged_hf.serving.ray.launch import build_application, start_local_ray, start_serve, stop_ray  # noqa: E402

KEY = "ray-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# a system prompt is 48 words (3 blocks of 16 tokens): 4 of them fill 12 blocks, 2 of them 6
SYSTEM_PROMPTS = [" ".join(random.Random(i).choices(WORDS, k=48)) for i in range(4)]
QUESTIONS = [" ".join(random.Random(100 + i).choices(WORDS, k=8)) for i in range(16)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("ray")
    folder = save_tiny_model(root / "model")
    start_local_ray(2, log_to_driver=False)
    port = free_port()
    try:
        start_serve("127.0.0.1", port)
        yield folder, root, f"http://127.0.0.1:{port}"
    finally:
        stop_ray()


def run_app(url: str, folder: str, root, routing: str) -> None:
    """2 replicas, each with 12 KV blocks: room for 2 system prompts and the requests running, not for 4."""
    args = build_parser().parse_args(["serve", "--model", folder, "--served-model-name", MODEL, "--api-key", KEY,
                                      "--num-blocks", "12", "--max-model-len", "96", "--dtype", "float32",
                                      "--lora-root", str(root), "--replicas", "2", "--routing", routing,
                                      "--num-cpus-per-replica", "1"])
    resolve_model_args(args)
    args.engine_config = engine_config(args)  # as `paged-hf serve` sets it
    serve.run(build_application(args), name="paged_hf", route_prefix="/")
    deadline = time.monotonic() + 300  # the HTTP proxy may still be starting on a busy machine
    while True:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "Ray Serve's HTTP proxy did not start"
        time.sleep(1)


def workload(url: str) -> set[str]:
    """4 system prompts x 16 questions, one at a time, shuffled; every one answered -> the replicas used."""
    jobs = [(s, q) for s in SYSTEM_PROMPTS for q in QUESTIONS]
    random.Random(0).shuffle(jobs)
    replicas = set()
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as client:
        for system, question in jobs:
            response = client.post("/v1/completions", json={"model": MODEL, "prompt": f"{system} {question}",
                                                            "max_tokens": 2, "temperature": 0})
            assert response.status_code == 200, response.text
            replicas.add(response.headers[REPLICA_HEADER])
    return replicas


def hit_rate(url: str) -> tuple[float, dict]:
    """Prefix-cache hits / queries over both replicas, from the ingress's /metrics (one sample per replica)."""
    text = httpx.get(url + "/metrics", headers=AUTH, timeout=60).text
    totals, per_replica = {}, {}
    for kind in ("queries", "hits"):
        for replica, value in re.findall(rf'^paged_hf_prefix_cache_{kind}_total{{replica="(\w+)"}} (\S+)$', text, re.M):
            per_replica.setdefault(replica, {})[kind] = float(value)
            totals[kind] = totals.get(kind, 0.0) + float(value)
    assert len(per_replica) == 2, text
    return totals["hits"] / totals["queries"], per_replica


def test_prefix_routing_beats_round_robin_and_adapters_find_their_replica(cluster, capsys):
    folder, root, url = cluster
    run_app(url, folder, root, "prefix")
    assert httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "the"}).status_code == 401
    assert httpx.get(url + "/metrics").status_code == 401
    assert len(workload(url)) == 2  # both replicas serve
    prefix_rate, prefix_stats = hit_rate(url)
    _streams_through_the_ingress(url)
    _adapter_requests_land_where_it_was_loaded(url, folder, root)

    serve.delete("paged_hf")
    run_app(url, folder, root, "round_robin")
    assert len(workload(url)) == 2
    round_robin_rate, round_robin_stats = hit_rate(url)
    with capsys.disabled():
        print(f"\nprefix-cache hit rate: prefix-aware {prefix_rate:.3f} {prefix_stats}, "
              f"round robin {round_robin_rate:.3f} {round_robin_stats}")
    assert prefix_rate > round_robin_rate + 0.1


def _streams_through_the_ingress(url: str) -> None:
    body = {"model": MODEL, "prompt": "the a of", "max_tokens": 5, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=AUTH, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert sum(len(json.loads(e)["choices"]) for e in events[:-1]) == 5


def _adapter_requests_land_where_it_was_loaded(url: str, folder: str, root) -> None:
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    make_adapter(AutoModelForCausalLM.from_pretrained(folder), root / "a1", seed=1, r=4, lora_alpha=8,
                 target_modules=["q_proj", "v_proj"])
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as client:
        loaded = client.post("/v1/load_lora_adapter", json={"lora_name": "tenant-a1", "lora_path": str(root / "a1")})
        assert loaded.status_code == 200, loaded.text
        home = loaded.headers[REPLICA_HEADER]
        assert "tenant-a1" in [card["id"] for card in client.get("/v1/models").json()["data"]]
        for question in QUESTIONS[:8]:
            response = client.post("/v1/completions", json={"model": "tenant-a1", "prompt": question, "max_tokens": 2})
            assert response.status_code == 200, response.text
            assert response.headers[REPLICA_HEADER] == home
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "tenant-a1"}).status_code == 200
        # gone under the name it was loaded as; its folder's own name stays served from the root (--lora-root)
        assert client.post("/v1/completions", json={"model": "tenant-a1", "prompt": "the"}).status_code == 404


def test_ingress_tokenizes_only_what_the_replica_takes():
    """No routing hint (so no tokenizing) for a request the replica will refuse: no API key, a body too large."""
    from types import SimpleNamespace  # noqa: PLC0415

    from starlette.requests import Request  # noqa: PLC0415

    from paged_hf.serving.openai import ServerSettings  # noqa: PLC0415
    from paged_hf.serving.ray.ingress import Ingress  # noqa: PLC0415

    ingress = SimpleNamespace(guard=ServerSettings(api_key=KEY, max_body_bytes=100))

    def passes(headers: dict, body: bytes) -> bool:
        scope = {"type": "http", "method": "POST", "path": "/v1/completions",
                 "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}
        return Ingress.passes_guard(ingress, Request(scope), body)

    assert passes(AUTH, b"{}")
    assert not passes({}, b"{}")
    assert not passes({"Authorization": "Bearer nope"}, b"{}")
    assert not passes(AUTH, b"x" * 101)
