"""Issue 49's probe on the real default model: `paged-hf serve` in its own process (two named keys, the fair
policy, a Responses store directory), one streaming completion running beside each row of
tests/serving/test_hostile_requests.py, the server's resident memory read from /proc before and after each.

    .venv/bin/python tests/scripts/issue49_probe.py [--rows embeddings,detokenize] [--prefix [--isolation key]]
        [--max-stream-gap 0.25]

Prints key B's answers to key A's stored response, then one line per row (status, seconds, the stream's
largest gap and the bound max(250 ms, 3x its median), the server's RSS change); with --prefix, the prefix
cache's timing instead (a long prompt's first token: cold, again from the same key, then from the other key).
A few minutes on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "serving")]

import hostile_probe  # noqa: E402
import httpx  # noqa: E402
import openai  # noqa: E402
from hostile_probe import KEYS, Watch, auth, encoded, issue_49_rows, rss_back_within, rss_mb  # noqa: E402

from paged_hf.utils import describe_host  # noqa: E402

ALICE, BOB = KEYS["alice"], KEYS["bob"]


def start_server(store: str, isolation: str, max_stream_gap: float | None) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    argv = [sys.executable, "-m", "paged_hf", "serve", "--served-model-name", "tiny", "--port", str(port),
            "--log-level", "warning", "--scheduling-policy", "fair", "--responses-store-dir", store,
            "--prefix-cache-isolation", isolation, *[f"--api-key={name}={key}" for name, key in KEYS.items()],
            *([] if max_stream_gap is None else ["--max-stream-gap", str(max_stream_gap)])]
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 300
    while True:
        assert process.poll() is None, process.stderr.read()
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.5)


def first_token_s(url: str, key: str, prompt: str) -> float:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    start = time.monotonic()
    assert httpx.post(url + "/v1/completions", json=body, headers=auth(key), timeout=600).status_code == 200
    return time.monotonic() - start


def run_rows(url: str, pid: int, selected: list[str]) -> None:
    rows = [(label, path, encoded(body), *rest) for label, path, body, *rest in issue_49_rows()
            if not selected or any(word in label for word in selected)]
    for label, path, body, status, _, _ in rows:
        with Watch(url, ALICE, max_tokens=64) as watch:
            before, start = rss_mb(pid), time.monotonic()
            response = watch.post(path, body, BOB, label)
            elapsed = time.monotonic() - start
            grown = rss_back_within(before, 50, pid, wait_s=3.0) - before
            watch.wait_gaps(3)  # the stream's gaps after the answer count too
        worst, bound = max(watch.gaps), watch.bound(0.25)
        print(f"{label:40s} {response.status_code} (want {status}) {elapsed:6.2f} s  largest gap "
              f"{worst * 1e3:5.0f} ms (bound {bound * 1e3:.0f}, median {statistics.median(watch.gaps) * 1e3:.0f})  "
              f"RSS {grown:+.0f} MB  {response.text[:90] if response.status_code != 200 else ''}", flush=True)
    client = openai.OpenAI(base_url=url + "/v1", api_key=BOB, max_retries=0, timeout=120)
    with Watch(url, ALICE, max_tokens=64) as watch:
        before, start = rss_mb(pid), time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda i: client.responses.create(model="tiny", input=f"flood {i}", max_output_tokens=2),
                          range(64)))
        elapsed, grown = time.monotonic() - start, rss_back_within(before, 50, pid, wait_s=3.0) - before
    print(f"{'a flood of 64 stored responses':40s} 200 {elapsed:6.2f} s  largest gap {max(watch.gaps) * 1e3:5.0f} ms "
          f"(bound {watch.bound(0.25) * 1e3:.0f})  RSS {grown:+.0f} MB", flush=True)


def run_isolation(url: str) -> None:
    alice = openai.OpenAI(base_url=url + "/v1", api_key=ALICE, max_retries=0, timeout=120)
    bob = openai.OpenAI(base_url=url + "/v1", api_key=BOB, max_retries=0, timeout=120)
    kept = alice.responses.create(model="tiny", input="a secret", max_output_tokens=4)
    answers = []
    for attempt in (lambda: bob.responses.retrieve(kept.id), lambda: bob.responses.delete(kept.id),
                    lambda: bob.responses.input_items.list(kept.id),
                    lambda: bob.responses.create(model="tiny", input="go on", previous_response_id=kept.id)):
        try:
            attempt()
            answers.append("200")
        except openai.APIStatusError as exc:
            answers.append(str(exc.status_code))
    print(f"key B on key A's stored response (GET, DELETE, input_items, previous_response_id): {answers}; "
          f"A still reads it: {alice.responses.retrieve(kept.id).output_text == kept.output_text}", flush=True)


def run_prefix_timing(url: str, words: int) -> None:
    prompt = " ".join(f"word{i}" for i in range(words))
    cold = first_token_s(url, ALICE, prompt)
    again = first_token_s(url, ALICE, prompt)
    other = first_token_s(url, BOB, prompt)
    print(f"{words}-word prompt, first token: cold {cold:.2f} s, same key again {again:.2f} s, other key "
          f"{other:.2f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--isolation", choices=("none", "key"), default="none")
    parser.add_argument("--max-stream-gap", type=float, default=None, help="serve's --max-stream-gap (default: off)")
    parser.add_argument("--rows", default="", help="comma list of words: only the rows whose label has one")
    parser.add_argument("--prefix", action="store_true", help="only the prefix-cache timing")
    parser.add_argument("--prefix-words", type=int, default=700, help="--prefix: the prompt's words (default 700, "
                        "~2,700 tokens)")
    args = parser.parse_args()
    hostile_probe.POST_TIMEOUT_S = 600  # a CPU may take minutes where the tiny test model takes seconds
    print(describe_host(), flush=True)
    with tempfile.TemporaryDirectory() as store:
        process, url = start_server(store, args.isolation, args.max_stream_gap)
        try:
            if args.prefix:
                run_prefix_timing(url, args.prefix_words)
            else:
                run_isolation(url)
                run_rows(url, process.pid, [word for word in args.rows.split(",") if word])
        finally:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(30)


if __name__ == "__main__":
    main()
