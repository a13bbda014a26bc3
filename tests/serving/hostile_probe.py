"""What the hostile-request tests share: a watch on a running stream and /health, bodies no client library
would write (950 levels of JSON), and a process's resident memory."""

from __future__ import annotations

import json
import resource
import statistics
import threading
import time

import httpx

KEYS = {"alice": "key-a", "bob": "key-b"}
POST_TIMEOUT_S = 60  # a probe request's client timeout (tests/scripts/issue49_probe.py raises it for the real model)


def auth(key: str | None) -> dict:
    return {} if key is None else {"Authorization": f"Bearer {key}"}


def rss_mb(pid: int | str = "self") -> float:
    """Process `pid`'s resident memory (MB)."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def rss_back_within(baseline: float, margin_mb: float, pid: int | str = "self", wait_s: float = 2.0) -> float:
    """Process `pid`'s resident memory once it is within `margin_mb` of `baseline`, or after `wait_s` (the server
    gives a large body's heap back after it answered: the client may read the answer first)."""
    deadline = time.monotonic() + wait_s
    while rss_mb(pid) - baseline >= margin_mb and time.monotonic() < deadline:
        time.sleep(0.05)
    return rss_mb(pid)


class Watch:
    """A background stream (its gaps between chunks, streamed again whenever it ends) and /health every 0.05 s
    (its latencies)."""

    def __init__(self, url: str, key: str | None = None, model: str = "tiny", max_tokens: int = 900):
        self.url, self.key, self.gaps, self.health, self.stop = url, key, [], [], threading.Event()
        self.body = {"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
                     "stream": True}
        self.gap_times, self.marks = [], []  # when each gap ended; (label, start, end) of each probe request
        self.threads = [threading.Thread(target=self._stream), threading.Thread(target=self._health)]

    def __enter__(self):
        for thread in self.threads:
            thread.start()
        time.sleep(0.5)
        self.wait_gaps(3)  # the stream is flowing
        return self

    def wait_gaps(self, count: int, timeout_s: float = 120) -> None:
        """Until the stream has `count` more gaps than now."""
        target, deadline = len(self.gaps) + count, time.monotonic() + timeout_s
        while len(self.gaps) < target and time.monotonic() < deadline:
            time.sleep(0.01)

    def __exit__(self, *exc):
        self.stop.set()
        for thread in self.threads:
            thread.join(30)

    def post(self, path: str, body: dict | bytes, key: str | None = "", label: str | None = None) -> httpx.Response:
        """`key`: "" for the watch's own key."""
        start = time.monotonic()
        try:
            return post(self.url, path, body, self.key if key == "" else key)
        finally:
            self.marks.append((label or f"{path} {sorted(body)[:6] if isinstance(body, dict) else ''}", start,
                               time.monotonic()))

    def bound(self, floor_s: float) -> float:
        """The largest gap allowed: `floor_s`, or 3x the median gap when that is larger."""
        return max(floor_s, 3 * statistics.median(self.gaps))

    def worst(self) -> list:
        """The longest gaps, with the probe requests in flight when they ended (for the failure message)."""
        ranked = sorted(zip(self.gaps, self.gap_times), reverse=True)[:3]
        return [(round(gap, 3), [label for label, a, b in self.marks if a <= end <= b + 0.05]) for gap, end in ranked]

    def _stream(self):
        while not self.stop.is_set():
            with httpx.stream("POST", self.url + "/v1/completions", json=self.body, headers=auth(self.key),
                              timeout=60) as response:
                assert response.status_code == 200
                last = None
                for line in response.iter_lines():
                    now = time.monotonic()
                    if line.startswith("data: {"):
                        if last is not None:
                            self.gaps.append(now - last)
                            self.gap_times.append(now)
                        last = now
                    if self.stop.is_set():
                        return

    def _health(self):
        with httpx.Client(timeout=30) as client:
            while not self.stop.is_set():
                start = time.monotonic()
                assert client.get(self.url + "/health").status_code == 200
                self.health.append(time.monotonic() - start)
                time.sleep(0.05)


class RawJson:
    """JSON text put into a body as is (Python's json cannot write 950 levels)."""

    def __init__(self, text: str):
        self.text = text


def encoded(body: dict) -> bytes:
    """The body's JSON text (RawJson parts as they are)."""
    raws = {}

    def placeholder(value: RawJson) -> str:
        marker = f"@raw{len(raws)}"
        raws[marker] = value.text
        return marker

    text = json.dumps(body, default=placeholder)
    for marker, value in raws.items():
        text = text.replace(json.dumps(marker), value)
    return text.encode()


def post(url: str, path: str, body: dict | bytes, key: str | None = None) -> httpx.Response:
    """`body`: a dict, or its JSON text already encoded (a megabyte body encoded in this process, where the server
    runs too, would hold the GIL as the server's work does: encode it before the watch starts)."""
    content = body if isinstance(body, bytes) else encoded(body)
    return httpx.post(url + path, content=content, headers={"Content-Type": "application/json", **auth(key)},
                      timeout=POST_TIMEOUT_S)


def nested_text(depth: int) -> str:
    """A JSON schema of `depth` nested arrays (depth + 1 levels of JSON)."""
    return '{"type":"array","items":' * depth + '{"type":"string"}' + "}" * depth


def nested_arrays(depth: int) -> dict:
    return json.loads(nested_text(depth))


def nested_objects_text(depth: int) -> str:
    """A JSON schema of `depth` nested objects: two levels of JSON each (properties, then the property)."""
    return '{"type":"object","properties":{"a":' * depth + '{"type":"string"}' + "}}" * depth


def chat(**fields) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


def messages(**fields) -> dict:
    return {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **fields}


def issue_49_rows() -> list[tuple]:
    """(label, path, body, status, seconds allowed, what the answer holds: the limit it names (or one of them),
    or a check of a 200)."""
    arrays, objects = RawJson(nested_text(500)), RawJson(nested_objects_text(500))  # 501 and 1,001 levels
    words = [f"text number {i}" for i in range(2048)]
    embedded = (lambda r: [d["index"] for d in r.json()["data"]] == list(range(2048)))
    return [
        ("messages: tool schema 500 deep, auto", "/v1/messages",
         messages(tools=[{"name": "f", "input_schema": arrays}], tool_choice={"type": "auto"}), 400, 10,
         "--max-grammar-depth"),
        ("messages: tool schema 500 deep, any", "/v1/messages",
         messages(tools=[{"name": "f", "input_schema": arrays}], tool_choice={"type": "any"}), 400, 10,
         "--max-grammar-depth"),
        ("messages: tool schema of 500 objects", "/v1/messages",
         messages(tools=[{"name": "f", "input_schema": objects}]), 400, 10, "--max-json-depth"),
        ("responses: tool schema 500 deep", "/v1/responses", {"model": "tiny", "input": "hi", "tools": [
            {"type": "function", "name": "f", "parameters": arrays}]}, 400, 10, "--max-grammar-depth"),
        ("chat: response_format 500 deep", "/v1/chat/completions", chat(response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": arrays}}), 400, 10, "max_grammar_depth"),
        ("embeddings: 2,048 strings", "/v1/embeddings", {"model": "tiny", "input": words}, 200, 30, embedded),
        ("embeddings: 2,048 strings, base64", "/v1/embeddings",
         {"model": "tiny", "input": words, "encoding_format": "base64"}, 200, 30, embedded),
        ("embeddings: 2,049 strings", "/v1/embeddings", {"model": "tiny", "input": [*words, "one more"]}, 400, 10,
         "--max-embedding-inputs"),
        ("responses: 200 input items", "/v1/responses", {"model": "tiny", "max_output_tokens": 4, "store": False,
                                                         "input": [{"role": "user", "content": "hi"}] * 200}, 200, 10,
         lambda r: r.json()["usage"]["input_tokens"] > 200),
        ("responses: 2,049 input items", "/v1/responses", {"model": "tiny", "input": [
            {"role": "user", "content": "hi"}] * 2049}, 400, 10, "--max-request-items"),
        ("messages: 5,000 content blocks", "/v1/messages", messages(messages=[
            {"role": "user", "content": [{"type": "text", "text": "hi "}] * 5000}]), 400, 10, "--max-request-items"),
        ("messages: 2,000 content blocks", "/v1/messages", messages(messages=[
            {"role": "user", "content": [{"type": "text", "text": "hi "}] * 2000}]), 200, 10,
         lambda r: r.json()["usage"]["input_tokens"] > 2000),
        ("detokenize: 1M ids", "/detokenize", {"tokens": [5] * 1_000_000}, 400, 10, "--max-detokenize-tokens"),
        ("detokenize: 100k ids", "/detokenize", {"tokens": [5] * 100_000}, 200, 10,
         lambda r: len(r.json()["prompt"]) >= 100_000),
        ("messages: a 1 MB system", "/v1/messages", messages(system="a b " * 250_000), 400, 20,
         ("maximum context length", "--chat-template-timeout")),  # tokenized in the render when escaping
    ]
