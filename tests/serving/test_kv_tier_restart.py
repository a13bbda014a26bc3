"""The KV tier's directory across a crash, on a real `paged-hf serve` process: SIGKILL while blocks are being
written leaves only whole block files; a restarted server with the same --kv-cache-dir serves the requests it saw
before from them with the cold run's greedy tokens; a truncated file and one overwritten with random bytes are
detected (counted, deleted, recomputed) and the output is still the cold run's."""

from __future__ import annotations

import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import safetensors.torch

pytest.importorskip("fastapi")

from serve_process import MODEL, ServerProcess, save_tiny_model  # noqa: E402

BLOCK = 16  # the server's default block size
PROMPT = 200  # tokens: 12 full blocks


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(7, 128) for _ in range(PROMPT)]


def complete(url: str, ids: list[int], max_tokens: int = 8) -> str:
    body = {"model": MODEL, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    response = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in /metrics")


def block_files(folder) -> set[str]:
    return {name for name in os.listdir(folder) if name.endswith(".safetensors")}


def landed(folder, at_least: int, timeout: float = 30) -> set[str]:
    """The block files once at least `at_least` are there and no more arrive for a moment."""
    deadline, seen = time.monotonic() + timeout, -1
    while True:
        files = block_files(folder)
        if len(files) >= at_least and len(files) == seen:
            return files
        assert time.monotonic() < deadline, f"{len(files)} block files, expected >= {at_least}"
        seen = len(files)
        time.sleep(0.2)


def test_sigkill_during_writes_then_restart_serves_whole_blocks_and_skips_bad_files(tmp_path):
    folder = save_tiny_model(tmp_path / "model")
    kv_dir = tmp_path / "kv"
    requests = [prompt(seed) for seed in range(3)]
    flags = ("--kv-cache-dir", str(kv_dir), "--dtype", "float32")
    with ServerProcess(folder, *flags) as server, ThreadPoolExecutor(4) as pool:
        cold, files_of = [], []
        for ids in requests:  # one at a time: each request's files are the ones that appeared with it
            before = block_files(kv_dir) if kv_dir.exists() else set()
            cold.append(complete(server.url, ids))
            files_of.append(landed(kv_dir, len(before) + PROMPT // BLOCK) - before)
        written = len(block_files(kv_dir))
        flood = [pool.submit(complete, server.url, prompt(100 + i), 240) for i in range(4)]  # blocks all along
        deadline = time.monotonic() + 60
        while len(block_files(kv_dir)) < written + 2 * PROMPT // BLOCK:
            assert time.monotonic() < deadline and not any(f.done() for f in flood), "the flood wrote nothing"
            time.sleep(0.02)
        assert not any(f.done() for f in flood)  # still generating, and writing a block every 16 tokens
        server.signal(signal.SIGKILL)
        server.process.wait(30)
    for name in block_files(kv_dir):  # whatever was in flight is lost; every file under a real name is whole
        safetensors.torch.load_file(kv_dir / name)
    truncated, overwritten = (sorted(kv_dir / name for name in files) for files in files_of[1:])
    for path in truncated:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    for path in overwritten:
        path.write_bytes(os.urandom(path.stat().st_size))
    with ServerProcess(folder, *flags) as server:
        assert complete(server.url, requests[0]) == cold[0]  # from the directory
        assert metric(server.url, "paged_hf_external_prefix_cache_hits_total") >= (PROMPT - 1) // BLOCK * BLOCK
        assert metric(server.url, "paged_hf_kv_tier_bad_files_total") == 0
        assert [complete(server.url, ids) for ids in requests[1:]] == cold[1:]  # recomputed
        assert metric(server.url, "paged_hf_kv_tier_bad_files_total") == 2  # each lookup stops at its first bad file
        hits = metric(server.url, "paged_hf_external_prefix_cache_hits_total")
        assert hits == (PROMPT - 1) // BLOCK * BLOCK  # the first request's alone: no bad block was loaded
