"""`paged-hf serve --tensor-parallel-size 2` (gloo, CPU): rank 0 serves HTTP, rank 1 mirrors its engine.

The server answers greedy requests (streamed and not, several at once) with the same tokens as one process,
and ends within seconds, with an error, when a rank is killed."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from serve_process import MODEL, ServerProcess, complete_greedy, kill_rank_mid_stream, save_tiny_model
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


def all_texts(url: str) -> list[str]:
    """Every prompt, streamed and not, all at once (they batch, and join a running batch)."""
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda job: complete_greedy(url, MODEL, *job), [(p, s) for s in (False, True) for p in PROMPTS]))


def single_process_texts(folder: str, all_texts=all_texts, **engine) -> list[str]:
    """`all_texts` of one process serving the float64 folder (the ranks' oracle), each answer non-empty."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    generator = paged_hf.wrap(model, AutoTokenizer.from_pretrained(folder), num_blocks=256, max_model_len=512,
                              max_num_batched_tokens=8, **engine).generator
    with serving(create_app(generator, generator.tokenizer, MODEL)) as url:
        expected = all_texts(url)
    assert all(text.strip() for text in expected)
    return expected


def send_bad_input_and_abandon_a_stream(url: str, prompt_words: int = 600, max_tokens: int = 300) -> None:
    """A prompt too long (refused on rank 0, reaching no other rank) and a stream abandoned after its first event
    (its abort reaches every rank): the ranks must stay in lockstep through both."""
    too_long = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "the " * prompt_words}, timeout=60)
    assert too_long.status_code == 400, too_long.text
    body = {"model": MODEL, "prompt": "the a of", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
        assert next(response.iter_lines()).startswith("data: ")


def test_tensor_parallel_server_gives_single_process_greedy_tokens(tp_server):
    folder, server = tp_server
    expected = single_process_texts(folder)
    send_bad_input_and_abandon_a_stream(server.url)
    assert all_texts(server.url) == expected


def test_killing_a_rank_ends_the_server_with_an_error(tp_server):
    output = kill_rank_mid_stream(tp_server[1])
    assert "a rank failed" in output, output[-3000:]
