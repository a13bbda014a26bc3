"""The real default model in float32 as 2 and 3 pipeline stages (`paged_hf.LLM(pipeline_parallel_size=N)`): with a
LoRA adapter and without, chunked prefill and preemption forced, every request's greedy tokens are one process's
(tests/engine/test_pipeline.py does the same, and more, on a tiny float64 model)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import paged_hf
from paged_hf import SamplingParams
from paged_hf.integrations.peft import save_random_adapter

pytest.importorskip("fastapi")

TEXTS = ["The history of the printing press begins in the fifteenth century, when a goldsmith in Mainz combined "
         "movable metal type, oil-based ink and a wooden press into one working system.",
         "Write a short poem about the sea at night.",
         "Explain in simple words how a paged key-value cache lets a server keep many conversations in memory at "
         "once, and why fixed-size blocks make sharing a common prefix between requests cheap and safe."]
ADAPTERS = [None, "tuned", None, "tuned"]  # the first two: one prompt, base and adapter
# 24 blocks of 4 tokens cannot hold the four prompts (12-40 tokens) and their 8 new tokens at once: preemption
ENGINE = dict(dtype="float32", block_size=4, num_blocks=24, max_num_batched_tokens=32, max_num_seqs=4,
              max_model_len=64)


@pytest.fixture(scope="module")
def served(converted, tmp_path_factory):
    """(folder, adapter, prompts, one process's greedy tokens)."""
    folder, tokenizer = str(converted[0]), converted[2]
    first, second, third = (tokenizer(text)["input_ids"] for text in TEXTS)
    prompts = [first, first, second, third]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    adapter = save_random_adapter(model, str(tmp_path_factory.mktemp("pp_default") / "adapter"), seed=4, std=0.1,
                                  r=8, target_modules=["q_proj", "v_proj", "down_proj"])
    llm = paged_hf.LLM(folder, adapters={"tuned": adapter}, **ENGINE)
    expected = _greedy(llm, prompts)
    assert llm.generator.scheduler.num_preemptions > 0
    assert expected[0] != expected[1]  # the adapter changes the answer
    return folder, adapter, prompts, expected


def _greedy(llm, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, adapter=ADAPTERS, use_tqdm=False)]


@pytest.mark.slow
@pytest.mark.parametrize("stages", [2, 3])
def test_stages_of_the_default_model_give_one_process_greedy_tokens(served, stages):
    folder, adapter, prompts, expected = served
    llm = paged_hf.LLM(folder, adapters={"tuned": adapter}, pipeline_parallel_size=stages, **ENGINE)
    try:
        got = _greedy(llm, prompts)
        assert llm.generator.scheduler.num_preemptions > 0
    finally:
        llm.close()
    assert got == expected
