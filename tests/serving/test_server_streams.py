"""Streamed text equals non-streamed text, request for request, over many concurrent requests with stop strings
(a real server, the real `openai` client)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from test_server import client, server  # noqa: E402,F401 - the module's server fixtures
from tiny_server import API_KEY, MODEL  # noqa: E402,F401 - the module's server fixtures

STOPS = [["e t"], ["th", "zz"], ["ou"], ["an", "ime"], ["s "], None]


def _request(i: int) -> dict:
    words = ["the time", "a man of water", "you and I", "his long day", "some people know", "what is it"]
    return dict(model=MODEL, prompt=f"{words[i % 6]} {words[(i * 5) % 6]}", max_tokens=8 + i % 9,
                temperature=0.0 if i % 2 else 0.9, seed=i, stop=STOPS[i % len(STOPS)])


def _one(client_, i: int) -> tuple:
    kwargs = _request(i)
    whole = client_.completions.create(**kwargs).choices[0]
    text, finish = "", None
    for chunk in client_.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            text += c.text
            finish = c.finish_reason or finish
    return whole.text, whole.finish_reason, text, finish


def test_64_streamed_requests_with_stop_strings_equal_non_streamed(client):  # noqa: F811
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda i: _one(client, i), range(64)))
    assert [(r[2], r[3]) for r in results] == [(r[0], r[1]) for r in results]
    assert sum(r[1] == "stop" for r in results) >= 8  # the stop strings did cut many of them (11 with this seed)
