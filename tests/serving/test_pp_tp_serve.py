"""`paged-hf serve --pipeline-parallel-size 2 --tensor-parallel-size 2` (gloo, CPU): 4 ranks, 2 stages of 2
tensor-parallel ranks each (every rank a slice of its stage's linears, loader/stage_shards.py).

The server answers greedy requests (streamed and not, several at once, micro-batches in flight, preemption forced
by 12 blocks of 4 tokens) with the same tokens as one process, and keeps its ranks in step through bad input and
an abandoned stream."""

from __future__ import annotations

import httpx
import pytest
import torch
from serve_process import MODEL, ServerProcess, save_tiny_model
from test_tp_serve import FLAGS, _all_texts
from tiny_server import serving
from transformers import AutoModelForCausalLM, AutoTokenizer

import paged_hf
from paged_hf.serving.openai import create_app

PRESSURE = ("--num-blocks", "12", "--block-size", "4", "--max-model-len", "40")  # 8 requests of up to 23 tokens


@pytest.fixture(scope="module")
def pp_tp_server(tmp_path_factory):
    folder = save_tiny_model(tmp_path_factory.mktemp("pp_tp") / "model")
    with ServerProcess(folder, "--pipeline-parallel-size", "2", "--tensor-parallel-size", "2", *FLAGS,
                       *PRESSURE, timeout=300) as server:
        yield folder, server


def test_two_stages_of_two_tensor_ranks_give_single_process_greedy_tokens(pp_tp_server):
    folder, server = pp_tp_server
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    generator = paged_hf.wrap(model, AutoTokenizer.from_pretrained(folder), num_blocks=256, max_model_len=512,
                              max_num_batched_tokens=8).generator
    with serving(create_app(generator, generator.tokenizer, MODEL)) as url:
        expected = _all_texts(url)
    assert all(text.strip() for text in expected)
    too_long = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "the " * 60}, timeout=60)
    assert too_long.status_code == 400, too_long.text
    body = {"model": MODEL, "prompt": "the a of", "max_tokens": 30, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        assert next(response.iter_lines()).startswith("data: ")  # then abandoned: its abort reaches every rank
    assert _all_texts(server.url) == expected
    metrics = httpx.get(server.url + "/metrics", timeout=60).text
    preemptions = next(line for line in metrics.splitlines() if line.startswith("paged_hf_num_preemptions_total"))
    assert float(preemptions.split()[-1]) > 0, preemptions
