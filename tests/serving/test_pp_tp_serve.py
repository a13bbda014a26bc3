"""`paged-hf serve --pipeline-parallel-size 2 --tensor-parallel-size 2` (gloo, CPU): 4 ranks, 2 stages of 2
tensor-parallel ranks each (every rank a slice of its stage's linears, loader/stage_shards.py).

The server answers greedy requests (streamed and not, several at once, micro-batches in flight, preemption forced
by 12 blocks of 4 tokens) with the same tokens as one process, and keeps its ranks in step through bad input and
an abandoned stream."""

from __future__ import annotations

import httpx
import pytest
from serve_process import ServerProcess, save_tiny_model
from test_tp_serve import FLAGS, all_texts, send_bad_input_and_abandon_a_stream, single_process_texts

PRESSURE = ("--num-blocks", "12", "--block-size", "4", "--max-model-len", "40")  # 8 requests of up to 23 tokens


@pytest.fixture(scope="module")
def pp_tp_server(tmp_path_factory):
    folder = save_tiny_model(tmp_path_factory.mktemp("pp_tp") / "model")
    with ServerProcess(folder, "--pipeline-parallel-size", "2", "--tensor-parallel-size", "2", *FLAGS,
                       *PRESSURE, timeout=300) as server:
        yield folder, server


def test_two_stages_of_two_tensor_ranks_give_single_process_greedy_tokens(pp_tp_server):
    folder, server = pp_tp_server
    expected = single_process_texts(folder)
    send_bad_input_and_abandon_a_stream(server.url, prompt_words=60, max_tokens=30)  # within 40 tokens
    assert all_texts(server.url) == expected
    metrics = httpx.get(server.url + "/metrics", timeout=60).text
    preemptions = next(line for line in metrics.splitlines() if line.startswith("paged_hf_num_preemptions_total"))
    assert float(preemptions.split()[-1]) > 0, preemptions
