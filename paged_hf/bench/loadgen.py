"""A streaming OpenAI load generator: `/v1/completions` with `stream=true`, like `vllm bench serve --backend
openai`. Requests start at a request rate (Poisson arrivals; inf = all at once) with at most `concurrency` in
flight; each one records when its chunks arrived, from which TTFT, TPOT and ITL follow.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

from paged_hf.utils import percentile


@dataclass
class RequestRecord:
    """One request as the client saw it (times in seconds from when it was sent)."""

    num_prompt_tokens: int
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    latency: float | None = None
    num_output_tokens: int = 0
    chunk_gaps: list[float] = field(default_factory=list)  # inter-token latencies: between content chunks

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (None for a one-token answer)."""
        if self.ttft is None or self.latency is None or self.num_output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.num_output_tokens - 1)


async def _one(session, url: str, body: dict, record: RequestRecord) -> None:
    start = time.perf_counter()
    last = None
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                record.error = f"HTTP {response.status}: {(await response.read())[:200]!r}"
                return
            async for line in response.content:  # one server-sent event line at a time
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    record.num_output_tokens = chunk["usage"]["completion_tokens"]
                if "error" in chunk:
                    record.error = str(chunk["error"])
                    return
                if any(choice.get("text") for choice in chunk.get("choices") or ()):
                    now = time.perf_counter()
                    if last is None:
                        record.ttft = now - start
                    else:
                        record.chunk_gaps.append(now - last)
                    last = now
        record.latency = time.perf_counter() - start
        record.ok = record.ttft is not None
    except Exception as exc:  # noqa: BLE001 - a failed request is a result, not a crash of the benchmark
        record.error = f"{type(exc).__name__}: {exc}"


async def run_load(base_url: str, model: str, prompts: list[list[int]], output_len: int, concurrency: int,
                   request_rate: float = float("inf"), seed: int = 0, timeout: float = 3600) -> tuple[list, float]:
    """Send every prompt (token ids, EOS ignored, greedy, exactly `output_len` tokens); -> (records, wall s).

    aiohttp, as `vllm bench serve` uses: the client shares the server's 2 cores here, and it costs less than
    half the CPU of httpx per streamed chunk (measured: 0.30 against 0.74 CPU-seconds for 8,192 chunks)."""
    import aiohttp  # noqa: PLC0415 - the bench/test extras have it

    rng = random.Random(seed)
    semaphore = asyncio.Semaphore(concurrency)
    records = [RequestRecord(len(p)) for p in prompts]

    async def limited(session, body, record):
        async with semaphore:
            await _one(session, base_url + "/v1/completions", body, record)

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        start = time.perf_counter()
        tasks = []
        for prompt, record in zip(prompts, records):
            body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            tasks.append(asyncio.create_task(limited(session, body, record)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    return records, wall


def _percentiles(values: list[float]) -> dict:
    return {f"p{q}": percentile(values, q) for q in (50, 90, 99)} | {"mean": statistics.fmean(values) if values else None}


def summarize(records: list[RequestRecord], wall: float) -> dict:
    """Output tok/s over the whole run, and TTFT/TPOT/ITL/latency percentiles in seconds."""
    done = [r for r in records if r.ok]
    output_tokens = sum(r.num_output_tokens for r in done)
    return {
        "num_requests": len(records), "num_ok": len(done),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "wall_s": wall, "output_tokens": output_tokens,
        "output_tok_s": output_tokens / wall if wall > 0 else 0.0,
        "ttft_s": _percentiles([r.ttft for r in done]),
        "tpot_s": _percentiles([r.tpot for r in done if r.tpot is not None]),
        "itl_s": _percentiles([gap for r in done for gap in r.chunk_gaps]),
        "latency_s": _percentiles([r.latency for r in done]),
    }
