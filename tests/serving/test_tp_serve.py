"""`paged-hf serve --tensor-parallel-size 2` (gloo, CPU): rank 0 serves HTTP, rank 1 mirrors its engine.

The server answers greedy requests (streamed and not, several at once) with the same tokens as one process,
and ends within seconds, with an error, when a rank is killed."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
import torch
from serve_process import MODEL, ServerProcess, save_tiny_model
from tiny_server import serving
from transformers import AutoModelForCausalLM, AutoTokenizer

import paged_hf
from paged_hf.serving.openai import create_app

PROMPTS = ["the a of", "you that he was for on are", "water than call first who may down side been now find",
           "in and is it"]
FLAGS = ("--dtype", "float64", "--max-num-batched-tokens", "8")  # float64: no rounding tie between the two ways


@pytest.fixture(scope="module")
def tp_server(tmp_path_factory):
    folder = save_tiny_model(tmp_path_factory.mktemp("tp") / "model")
    with ServerProcess(folder, "--tensor-parallel-size", "2", *FLAGS, timeout=240) as server:
        yield folder, server


def _complete(url: str, prompt: str, stream: bool) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": stream}
    if not stream:
        response = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]
    text = ""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def _all_texts(url: str) -> list[str]:
    """Every prompt, streamed and not, all at once (they batch, and join a running batch)."""
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda job: _complete(url, *job), [(p, s) for s in (False, True) for p in PROMPTS]))


def test_tensor_parallel_server_gives_single_process_greedy_tokens(tp_server):
    folder, server = tp_server
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    generator = paged_hf.wrap(model, AutoTokenizer.from_pretrained(folder), num_blocks=256, max_model_len=512,
                              max_num_batched_tokens=8).generator
    with serving(create_app(generator, generator.tokenizer, MODEL)) as url:
        expected = _all_texts(url)
    assert all(text.strip() for text in expected)
    # bad input reaches no other rank, an abandoned stream's abort reaches every rank: both stay in lockstep
    too_long = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "the " * 600}, timeout=60)
    assert too_long.status_code == 400, too_long.text
    body = {"model": MODEL, "prompt": "the a of", "max_tokens": 300, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        assert next(response.iter_lines()).startswith("data: ")
    assert _all_texts(server.url) == expected


def test_killing_a_rank_ends_the_server_with_an_error(tp_server):
    _, server = tp_server
    ranks = {proc.environ().get("RANK"): proc for proc in psutil.Process(server.process.pid).children()}
    assert set(ranks) == {"0", "1"}, ranks
    body = {"model": MODEL, "prompt": "the a of", "max_tokens": 500, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")  # the request runs on both ranks
        ranks["1"].kill()
        killed = time.monotonic()
        try:
            list(lines)  # ends (an error event, or the connection closes), never hangs
        except httpx.HTTPError:
            pass
    server.process.wait(timeout=30)
    assert time.monotonic() - killed < 20
    output = server.process.stdout.read()
    assert server.process.returncode != 0
    assert "a rank failed" in output, output[-3000:]
