"""`paged-hf serve --pipeline-parallel-size 2` (gloo, CPU): rank 0 serves HTTP and runs the first layers, rank 1
the last ones and samples; micro-batches in flight.

The server answers greedy requests (streamed and not, with a LoRA adapter and without, several at once) with the
same tokens as one process, survives bad input and an abandoned stream, and ends within seconds, with an error,
when a stage is killed."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from serve_process import MODEL, ServerProcess, complete_greedy, kill_rank_mid_stream, save_tiny_model
from test_tp_serve import (FLAGS, PROMPTS,  # the same prompts, flags and checks as tensor parallelism's
                           send_bad_input_and_abandon_a_stream, single_process_texts)
from transformers import AutoModelForCausalLM

from paged_hf.integrations.peft import save_random_adapter



@pytest.fixture(scope="module")
def pp_server(tmp_path_factory):
    folder = save_tiny_model(tmp_path_factory.mktemp("pp") / "model")
    adapter = save_random_adapter(AutoModelForCausalLM.from_pretrained(folder), folder + "-adapter", seed=3, std=0.5,
                                  r=4, target_modules=["q_proj", "v_proj", "down_proj"])
    with ServerProcess(folder, "--pipeline-parallel-size", "2", "--lora-modules", f"tuned={adapter}", *FLAGS,
                       timeout=240) as server:
        yield folder, adapter, server


def _all_texts(url: str) -> list[str]:
    """Every prompt, base and adapter, streamed and not, all at once (they batch, and join running batches)."""
    jobs = [(m, p, s) for m in (MODEL, "tuned") for s in (False, True) for p in PROMPTS]
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda job: complete_greedy(url, *job), jobs))


def test_pipeline_server_gives_single_process_greedy_tokens(pp_server):
    folder, adapter, server = pp_server
    expected = single_process_texts(folder, _all_texts, adapters={"tuned": adapter})
    assert expected[:8] != expected[8:]  # the adapter changes the answers
    send_bad_input_and_abandon_a_stream(server.url)
    assert _all_texts(server.url) == expected


def test_killing_a_stage_ends_the_server_with_an_error(pp_server):
    output = kill_rank_mid_stream(pp_server[2], rank="1")  # the last stage: the first waits on its tokens
    assert "a rank failed" in output, output[-3000:]
