"""The server's lifetimes, on a real `paged-hf serve` process with real clients: nothing slow on the event loop,
a client that leaves before its first chunk, SIGTERM's drain and a second SIGTERM; and one request's exception
failing only that request (a real uvicorn server in this process, so the fault can be injected)."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from serve_process import MODEL, ServerProcess, save_tiny_model  # noqa: E402
from tiny_server import WORDS  # noqa: E402

LONG = 450  # tokens: a few seconds of the tiny model


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny_model"))


def in_flight(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("paged_hf_num_requests_in_flight "):
            return float(line.split()[1])
    raise AssertionError("no in-flight gauge")


def finished(url: str) -> dict:
    """Finished sequences per finish reason, from /metrics."""
    counts = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("paged_hf_sequences_finished_total{"):
            counts[line.split('"')[1]] = float(line.split()[-1])
    return counts


def complete(url: str, **body):
    return httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "the time", "temperature": 0,
                                                      "ignore_eos": True, **body}, timeout=120)


def stream_finish(url: str, first_chunk: threading.Event | None = None, **body) -> str | None:
    """A streamed completion read to its end; -> the finish_reason it reported."""
    finish = None
    with httpx.stream("POST", url + "/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": "the time", "temperature": 0, "ignore_eos": True, "stream": True, **body}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                if first_chunk is not None:
                    first_chunk.set()
                finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
    return finish


def test_a_large_prompt_is_tokenized_off_the_event_loop(folder):
    """A 3.9 MB chat message takes seconds to template and tokenize; /health answers meanwhile (it waited the
    whole tokenization when that ran on the event loop)."""
    text = " ".join(WORDS[i % len(WORDS)] for i in range(900000))[:3_900_000]
    with ServerProcess(folder) as server, ThreadPoolExecutor(1) as pool:
        start = time.monotonic()
        big = pool.submit(httpx.post, server.url + "/v1/chat/completions", timeout=120,
                          json={"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4})
        latencies = []
        while not big.done():
            t = time.monotonic()
            assert httpx.get(server.url + "/health", timeout=60).status_code == 200
            latencies.append(time.monotonic() - t)
            time.sleep(0.05)
        took = time.monotonic() - start
        assert big.result().status_code == 400  # far longer than max_model_len, found once tokenized
        assert in_flight(server.url) == 0  # its --max-queue slot came back
    # on the event loop, a /health sent just after the prompt would wait about the whole tokenization
    assert took > 1.0, f"the prompt was too quick ({took:.1f} s) to show a stall"
    assert max(latencies) < took / 2, (max(latencies), took)


def test_client_gone_before_the_first_chunk_aborts_its_request(tmp_path):
    """The client sends a streamed chat request and leaves while its (slow) chat template renders, before any
    chunk: the request is aborted, not run to its end for nobody."""
    slow = "{% for i in range(100000) %}{% for j in range(60) %}{% endfor %}{% endfor %}"  # ~1.5 s per render
    with ServerProcess(save_tiny_model(tmp_path, chat_template_prefix=slow)) as server:
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "the time"}], "stream": True,
                           "max_tokens": LONG, "ignore_eos": True}).encode()  # runs long unless aborted
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            time.sleep(0.3)
        deadline = time.monotonic() + 60
        while in_flight(server.url) or not finished(server.url):
            assert time.monotonic() < deadline, "the request neither finished nor was aborted"
            time.sleep(0.05)
        assert finished(server.url) == {"abort": 1}


def test_sigterm_drains_then_aborts_and_answers_every_request(folder):
    """6 long requests, one running at a time: SIGTERM gives them the grace period, then every one of them,
    queued ones included, ends with finish_reason "abort", and the process exits by itself."""
    # a short grace: on a quiet machine one request of LONG tokens takes ~0.3 s, so a 1 s grace let half finish
    with ServerProcess(folder, "--max-num-seqs", "1", "--shutdown-grace", "0.2") as server, \
            ThreadPoolExecutor(6) as pool:
        first = threading.Event()
        streams = [pool.submit(stream_finish, server.url, first, max_tokens=LONG) for _ in range(3)]
        plain = [pool.submit(complete, server.url, max_tokens=LONG) for _ in range(3)]
        assert first.wait(30)
        deadline = time.monotonic() + 30  # all 6 admitted (a quick one may already have ended), bounded
        while in_flight(server.url) + sum(finished(server.url).values()) < 6:
            assert time.monotonic() < deadline, "the 6 requests were never admitted"
            time.sleep(0.02)
        num_done_before = sum(finished(server.url).values())
        start = time.monotonic()
        server.signal(signal.SIGTERM)
        finishes = [f.result(timeout=30) for f in streams]
        finishes += [f.result(timeout=30).json()["choices"][0]["finish_reason"] for f in plain]
        assert server.process.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it drained on
        took = time.monotonic() - start
    # one request runs at a time: at most the running one ends within the grace, every queued one is aborted
    assert set(finishes) <= {"abort", "length"} and finishes.count("abort") >= 6 - num_done_before - 1, finishes
    assert took < 15, took


def test_a_second_sigterm_exits_at_once(folder):
    with ServerProcess(folder, "--max-num-seqs", "1", "--shutdown-grace", "120") as server, \
            ThreadPoolExecutor(8) as pool:
        first = threading.Event()
        pool.submit(stream_finish, server.url, first, max_tokens=LONG)
        for _ in range(7):  # queued: many seconds of work
            pool.submit(complete, server.url, max_tokens=LONG)
        assert first.wait(30)
        deadline = time.monotonic() + 30  # all 8 admitted before the signal (~0.3 s a request when quiet)
        while in_flight(server.url) + sum(finished(server.url).values()) < 8:
            assert time.monotonic() < deadline, "the 8 requests were never admitted"
            time.sleep(0.02)
        server.signal(signal.SIGTERM)
        time.sleep(0.1)
        assert server.process.poll() is None  # draining: 120 s of grace
        start = time.monotonic()
        server.signal(signal.SIGTERM)
        server.process.wait(10)
        assert time.monotonic() - start < 3


def test_an_exception_of_one_request_fails_only_that_request(monkeypatch):
    """A request whose text cannot be decoded gets a 500 (or an error event), the requests beside it run on."""
    import torch
    from conftest import assert_no_leak, tiny_model
    from tiny_server import serving, tiny_tokenizer

    import paged_hf
    from paged_hf.engine.detokenizer import IncrementalDetokenizer
    from paged_hf.serving.openai import ServerSettings, create_app

    original = IncrementalDetokenizer.update

    def update(self, token_ids):  # the fault: this one request's text cannot be decoded
        if "boom" in self.stop and len(self.token_ids) >= 3:
            raise RuntimeError("cannot decode")
        return original(self, token_ids)

    monkeypatch.setattr(IncrementalDetokenizer, "update", update)
    generator = paged_hf.wrap(tiny_model("llama", dtype=torch.float32), tiny_tokenizer(), num_blocks=128,
                              max_model_len=512).generator
    with serving(create_app(generator, generator.tokenizer, MODEL, ServerSettings())) as url, \
            ThreadPoolExecutor(8) as pool:
        good = [pool.submit(complete, url, max_tokens=60) for _ in range(6)]
        bad = pool.submit(complete, url, max_tokens=60, stop=["boom"])
        streamed = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "the time", "max_tokens": 60, "stop": ["boom"], "stream": True}).text
        assert bad.result().status_code == 500 and "cannot decode" in bad.result().text
        assert '"error"' in streamed and "cannot decode" in streamed and streamed.endswith("data: [DONE]\n\n")
        for future in good:
            choice = future.result().json()["choices"][0]
            assert future.result().status_code == 200 and choice["finish_reason"] == "length"
    assert_no_leak(generator)
