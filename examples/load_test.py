"""Load test: many concurrent clients against `paged-hf serve`; success rate and latency percentiles.

Starts a server (or uses --base-url), fires --requests chat or completion requests from --concurrency threads,
streaming so that time to first token is measured too, and prints the success rate, the error kinds, and the
p50/p90/p99 of end-to-end latency and TTFT, plus the server's own /metrics summary. A failed request is
counted, not fatal: the point is to see how the server behaves at its limits (e.g. 503 past --max-queue).

    python examples/load_test.py [--model PATH] [--requests 64] [--concurrency 16] [--max-tokens 32]
        [--completions] [--base-url URL --api-key KEY] [-- extra `paged-hf serve` flags]
"""

from __future__ import annotations

import argparse
import secrets
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
from multi_tenant_server import QUESTIONS, start_server, stop_server


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (no numpy needed for a handful of numbers)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def one_request(client: openai.OpenAI, model: str, i: int, max_tokens: int, completions: bool) -> dict:
    """One streamed request: its latency, TTFT and token count, or the kind of error it got."""
    question = QUESTIONS[i % len(QUESTIONS)]
    start = time.perf_counter()
    first = None
    num_chunks = 0
    try:
        if completions:
            stream = client.completions.create(model=model, prompt=question, max_tokens=max_tokens, stream=True, seed=i)
            texts = (c.choices[0].text if c.choices else "" for c in stream)
        else:
            stream = client.chat.completions.create(model=model, max_tokens=max_tokens, stream=True, seed=i,
                                                    messages=[{"role": "user", "content": question}])
            texts = (c.choices[0].delta.content if c.choices else "" for c in stream)
        for text in texts:
            if text and first is None:
                first = time.perf_counter() - start
            num_chunks += bool(text)
    except openai.APIStatusError as exc:
        return {"ok": False, "error": f"HTTP {exc.status_code}"}
    except openai.APIError as exc:
        return {"ok": False, "error": type(exc).__name__}
    return {"ok": True, "latency": time.perf_counter() - start, "ttft": first, "chunks": num_chunks}


def report(results: list[dict], wall: float) -> None:
    ok = [r for r in results if r["ok"]]
    errors = Counter(r["error"] for r in results if not r["ok"])
    print(f"success: {len(ok)}/{len(results)} ({100 * len(ok) / len(results):.1f} %) in {wall:.1f} s, "
          f"{len(results) / wall:.2f} req/s" + (f"; errors: {dict(errors)}" if errors else ""))
    for name in ("latency", "ttft"):
        values = [r[name] for r in ok if r[name] is not None]
        if values:
            print(f"{name:>8}: p50 {percentile(values, 50):.3f} s  p90 {percentile(values, 90):.3f} s  "
                  f"p99 {percentile(values, 99):.3f} s  max {max(values):.3f} s")


def server_summary(base_url: str, api_key: str) -> None:
    """A few lines of the server's own view (/metrics)."""
    text = httpx.get(base_url + "/metrics", headers={"Authorization": f"Bearer {api_key}"}, timeout=10).text
    wanted = ("paged_hf_num_preemptions_total", "paged_hf_prefix_cache_hits_total", "paged_hf_prefix_cache_queries_total",
              "paged_hf_time_to_first_token_seconds_sum", "paged_hf_time_to_first_token_seconds_count",
              "paged_hf_sequences_finished_total")
    lines = [line for line in text.splitlines() if line.startswith(wanted)]
    print("server /metrics:\n  " + "\n  ".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder or hub id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--completions", action="store_true", help="/v1/completions instead of chat")
    parser.add_argument("--base-url", default=None, help="use a running server instead of starting one")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("serve_args", nargs="*", help="extra flags for `paged-hf serve` (after --)")
    args = parser.parse_args()

    process, api_key, base_url = None, args.api_key or secrets.token_hex(16), args.base_url
    if base_url is None:
        process, base_url = start_server((["--model", args.model] if args.model else []) + args.serve_args, api_key)
    base_url = base_url.rstrip("/")
    try:
        client = openai.OpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        start = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            results = list(pool.map(lambda i: one_request(client, model, i, args.max_tokens, args.completions),
                                    range(args.requests)))
        report(results, time.perf_counter() - start)
        server_summary(base_url, api_key)
    finally:
        stop_server(process)


if __name__ == "__main__":
    main()
