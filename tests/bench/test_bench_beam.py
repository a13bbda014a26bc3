"""`paged-hf bench --workload beam`: the engine's beam search against HF generate(num_beams=k), same outputs."""

from __future__ import annotations

import sys

from conftest import random_prompts, tiny_model

from paged_hf.bench import parse_systems, sized_engine_config, vllm_system
from paged_hf.bench.systems import run_system, skip_reason
from paged_hf.bench.workloads import WORKLOAD_NAMES, BenchRequest, Workload


class _Tokenizer:
    """What the systems need of a tokenizer with token-id prompts: a pad id, the warm-up prompt, decode."""

    pad_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [5, 6, 7]}

    def decode(self, token_ids, skip_special_tokens=False):
        return " ".join(map(str, token_ids))


def beam_workload() -> Workload:
    requests = [BenchRequest(p, 7) for p in random_prompts([9, 23, 14], seed=4)]  # one length: as build_beam
    return Workload("beam", "test", 0, requests, num_beams=3)


def test_beam_workload_runs_on_the_engine_and_in_hf_with_the_same_best_beams():
    model = tiny_model("llama")
    workload = Workload.from_json(beam_workload().to_json())  # what a worker process reads
    assert workload.num_beams == 3 and "beam" in WORKLOAD_NAMES
    config = sized_engine_config({"block_size": 4}, workload)
    engine = run_system("paged_hf", model, _Tokenizer(), workload, config)
    assert engine.error is None, engine.error
    single = run_system("hf_single", model, _Tokenizer(), workload, config)
    batched = run_system("hf_static_8", model, _Tokenizer(), workload, config)
    assert engine.outputs == single.outputs == batched.outputs
    assert [len(o) for o in engine.outputs] == [7, 7, 7]
    assert engine.extra["num_block_copies"] > 0  # beams forked, copy-on-write of partial blocks


def test_beam_workload_systems_and_sizing():
    workload = beam_workload()
    assert parse_systems(None, "beam") == ["paged_hf", "hf_static_8", "hf_single"]
    assert "beam search" in skip_reason("hf_cb", workload, {})
    assert "beam search" in vllm_system.skip_reason(sys.executable, workload, "cpu")
    # per request: its prompt's full blocks once, then each beam's own blocks
    one = Workload("beam", "", 0, [BenchRequest([1] * 20, 13)], num_beams=4)
    assert sized_engine_config({}, one)["num_blocks"] == 1 + 4 * (3 - 1) + 4
