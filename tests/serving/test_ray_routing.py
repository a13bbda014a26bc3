"""The replicas' router's pure parts (no Ray): block hashes as the prefix cache makes them, the prefix-owner
map, and one Prometheus exposition out of several replicas'."""

from __future__ import annotations

import json

from conftest import random_prompts, tiny_model
from tiny_server import WORDS, tiny_tokenizer

import paged_hf
from paged_hf import SamplingParams
from paged_hf.serving.ray.exposition import merge_expositions
from paged_hf.serving.ray.routing import PrefixOwners, RoutingHint, prompt_block_hashes, routing_hint


def test_block_hashes_are_the_prefix_caches_own():
    generator = paged_hf.wrap(tiny_model("llama"), num_blocks=32, block_size=4).generator
    prompt = random_prompts([11])[0]
    generator.generate([prompt], SamplingParams(max_new_tokens=1), use_tqdm=False)
    hashes = prompt_block_hashes(prompt, 4)
    assert len(hashes) == 2  # full blocks only
    assert all(h in generator.block_pool.cached_blocks for h in hashes)
    assert prompt_block_hashes(prompt, 4, adapter="a")[0] != hashes[0]  # an adapter's blocks are its own
    assert prompt_block_hashes(prompt, 4, cache_salt="s")[0] != hashes[0]
    assert prompt_block_hashes(prompt, 4, max_blocks=1) == hashes[:1]


def test_routing_hint_hashes_the_prompt_the_engine_gets():
    """The ingress reads a request as the replica's server will: a chat's list-of-parts content, the request's
    own template and its chat_template_kwargs, truncate_prompt_tokens; a completion's adapter and salt."""
    tokenizer = tiny_tokenizer()
    words = " ".join(WORDS[:24])
    template = ("{% if extra %}<system> time {% endif %}"
                "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}")
    chat = {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": words}]}],
            "chat_template": template, "chat_template_kwargs": {"extra": True}, "truncate_prompt_tokens": 20}
    expected = tokenizer(f"<system> time <user> {words} ", add_special_tokens=False)["input_ids"][-20:]
    hint = routing_hint("/v1/chat/completions", json.dumps(chat).encode(), tokenizer, {"tiny"}, 4,
                        trust_request_chat_template=True)
    assert hint.block_hashes == prompt_block_hashes(expected, 4) and hint.adapter is None
    untrusted = routing_hint("/v1/chat/completions", json.dumps(chat).encode(), tokenizer, {"tiny"}, 4)
    assert untrusted == RoutingHint()  # the replicas refuse it: nothing is rendered here either
    completion = {"model": "a1", "prompt": words, "cache_salt": "s"}
    hint = routing_hint("/v1/completions", json.dumps(completion).encode(), tokenizer, {"tiny"}, 4)
    ids = tokenizer(words)["input_ids"]
    assert hint.adapter == "a1" and hint.block_hashes == prompt_block_hashes(ids, 4, "a1", "s")
    assert routing_hint("/v1/completions", b"{not json", tokenizer, {"tiny"}, 4) == RoutingHint()


def test_prefix_owners_longest_match_roots_and_capacity():
    owners = PrefixOwners(capacity=5)
    owners.record([b"a", b"ab", b"abc"], "r1")
    owners.record([b"a", b"ab"], "r2")  # the shared part moves to r2; r1 keeps its longer prefix
    assert owners.longest_match([b"a", b"ab", b"abc", b"abcd"], {"r1", "r2"}) == ("r1", 3)
    assert owners.longest_match([b"a", b"ab", b"abx"], {"r1", "r2"}) == ("r2", 2)
    assert owners.longest_match([b"a", b"ab", b"abc"], {"r2"}) == ("r2", 2)  # only where it may go
    assert (owners.num_roots("r1"), owners.num_roots("r2")) == (0, 1)
    owners.record([b"x", b"xy", b"xyz"], "r1")  # 6 hashes > capacity 5: the oldest ("abc") goes
    assert owners.longest_match([b"a", b"ab", b"abc"], {"r1"}) == (None, 0)
    owners.forget("r2")
    assert owners.longest_match([b"a"], {"r1", "r2"}) == (None, 0)
    assert (owners.num_roots("r1"), owners.num_roots("r2")) == (1, 0)


def test_merged_exposition_labels_each_replica_and_keeps_families_whole():
    text = ("# HELP m_total Things.\n# TYPE m_total counter\nm_total 3\n"
            "# HELP h Latency.\n# TYPE h histogram\nh_bucket{le=\"0.1\"} 1\nh_count 1\n")
    merged = merge_expositions({"r2": text.replace("3", "5"), "r1": text})
    assert merged.count("# HELP m_total") == 1 and merged.count("# TYPE h histogram") == 1
    lines = merged.splitlines()
    assert lines[2:4] == ['m_total{replica="r1"} 3', 'm_total{replica="r2"} 5']
    assert 'h_bucket{replica="r1",le="0.1"} 1' in lines
    assert lines.index('h_count{replica="r2"} 1') > lines.index("# TYPE h histogram")
