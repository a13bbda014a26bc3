"""Pipeline parallelism: `paged_hf.LLM(..., pipeline_parallel_size=N)`, N processes each holding a run of the
layers, micro-batches in flight, against one process and HF's generate (float64, a tiny 5-layer Llama)."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from conftest import VOCAB, hf_greedy, random_prompts

import paged_hf
from paged_hf import SamplingParams
from paged_hf.integrations.peft import save_random_adapter
from paged_hf.loader.pipeline_stage import MissingModule, load_stage, stage_layout

pytest.importorskip("fastapi")
from tiny_server import tiny_tokenizer  # noqa: E402

PROMPTS = random_prompts([19, 5, 11, 33, 7])
ADAPTERS = [None, "tuned", None, "tuned", None]
# blocks of 4 tokens, chunks of 8: prompts go in chunks, and 18 blocks cannot hold all five at once (preemption)
ENGINE = dict(dtype="float64", block_size=4, num_blocks=18, max_num_batched_tokens=8, max_num_seqs=8, max_model_len=64)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("pipeline") / "model"
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=5,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.float64).eval()
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    adapter = save_random_adapter(model, str(path) + "-adapter", seed=1, std=0.3, r=4,
                                  target_modules=["q_proj", "v_proj", "gate_proj"])
    return str(path), adapter, model


def _params() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True, logprobs=2, prompt_logprobs=1),
            SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, n=2),
            SamplingParams(max_tokens=8, temperature=0.8, top_k=20, seed=3, ignore_eos=True),
            SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop_token_ids=[9])]


def _summary(outputs) -> list:
    return [[[c.token_ids for c in o.outputs], [c.logprobs for c in o.outputs], o.prompt_logprobs] for o in outputs]


def _close(a, b) -> bool:
    """Equal, floats within 1e-9 (micro-batches are other matmul shapes: float64 sums in another order)."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=0, abs_tol=1e-9)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    return a == b


@pytest.fixture(scope="module")
def one_process(folder):
    path, adapter, _ = folder
    llm = paged_hf.LLM(path, adapters={"tuned": adapter}, **ENGINE)
    return _summary(llm.generate(PROMPTS, _params(), adapter=ADAPTERS, use_tqdm=False))


@pytest.mark.parametrize("stages", [2, 3])
def test_stages_give_one_process_outputs(folder, one_process, stages):
    path, adapter, model = folder
    llm = paged_hf.LLM(path, adapters={"tuned": adapter}, pipeline_parallel_size=stages, **ENGINE)
    try:
        got = _summary(llm.generate(PROMPTS, _params(), adapter=ADAPTERS, use_tqdm=False))
        assert llm.generator.scheduler.num_preemptions > 0  # the pool was too small: preemption ran
        assert llm.generator.engine_step.depth == stages  # one micro-batch in flight per stage
        again = llm.generate(PROMPTS[:1], _params()[:1], use_tqdm=False)  # the stages stay in step across calls
    finally:
        llm.close()
    assert all(not p.is_alive() for p in llm.stages.processes)
    assert _close(got, one_process)
    assert got[0][0][0] == hf_greedy(model, PROMPTS[0], 8)  # and the oracle's, for a base greedy request
    assert again[0].outputs[0].token_ids == got[0][0][0]
    assert got[1][2] is not None and got[3][0][0] != got[1][0][0]  # prompt logprobs came back; adapters differ


def test_one_batch_in_flight_gives_the_same_outputs(folder, one_process):
    path, adapter, _ = folder
    llm = paged_hf.LLM(path, adapters={"tuned": adapter}, pipeline_parallel_size=2, pipeline_batches_in_flight=1,
                       **ENGINE)
    try:
        assert llm.generator.engine_step.depth == 1
        got = _summary(llm.generate(PROMPTS, _params(), adapter=ADAPTERS, use_tqdm=False))
        with pytest.raises(ValueError, match="beam search: not served pipeline-parallel"):
            llm.generator.add_beam_request([1, 2, 3], paged_hf.BeamSearchParams(beam_width=2, max_tokens=2))
        with pytest.raises(ValueError, match="embedding requests: not served pipeline-parallel"):
            llm.embed("the time")
    finally:
        llm.close()
    assert _close(got, one_process)


def test_a_stage_holds_only_its_layers(folder):
    path, _, model = folder
    stages = [load_stage(path, torch.float64, "cpu", i, 2) for i in range(2)]
    assert [(s.pipeline_stage.start, s.pipeline_stage.end) for s in stages] == [(0, 3), (3, 5)]
    first, last = stages
    assert isinstance(first.lm_head, MissingModule) and isinstance(first.model.norm, MissingModule)
    assert isinstance(last.model.embed_tokens, MissingModule)
    assert [isinstance(layer, MissingModule) for layer in last.model.layers] == [True] * 3 + [False] * 2
    whole = dict(model.named_parameters())
    for stage in stages:
        for name, tensor in stage.named_parameters():
            source = "model.embed_tokens.weight" if name == "lm_head.weight" else name  # the tied head
            assert torch.equal(tensor, whole[source]), name
    counts = [sum(p.numel() for p in s.parameters()) for s in stages]
    embedding = model.model.embed_tokens.weight.numel()
    assert sum(counts) == sum(p.numel() for p in model.parameters()) + embedding  # the tied head, once per end


def test_layers_split_by_work_and_bad_sizes_are_refused(monkeypatch):
    def split(num_layers, count, head_layers=0.0):
        return [(s.start, s.end) for s in (stage_layout(num_layers, i, count, head_layers) for i in range(count))]

    assert split(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]  # no head: even, the first stages one more
    assert split(30, 2, head_layers=2.0) == [(0, 16), (16, 30)]  # the last stage's LM head weighs 2 layers
    assert split(30, 2, head_layers=100.0) == [(0, 29), (29, 30)]  # a stage keeps at least one layer
    monkeypatch.setenv("PAGED_HF_PP_LAYER_PARTITION", "20,10")
    assert split(30, 2, head_layers=2.0) == [(0, 20), (20, 30)]
    monkeypatch.setenv("PAGED_HF_PP_LAYER_PARTITION", "20,11")
    with pytest.raises(ValueError, match="give 2 layer counts >= 1 that add up to 30"):
        split(30, 2)
    with pytest.raises(ValueError, match=r"pipeline_parallel_size must be in \[1, 5\]"):
        stage_layout(5, 0, 6)
    with pytest.raises(ValueError, match="pipeline_parallel_size must be an int >= 1"):
        paged_hf.LLM("unused", pipeline_parallel_size=0)


def test_a_model_without_a_pipeline_plan_is_refused(tmp_path):
    config = transformers.BioGptConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4)
    transformers.BioGptForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="BioGptConfig cannot be served pipeline-parallel"):
        load_stage(tmp_path, torch.float32, "cpu", 0, 2)


def test_what_a_pipeline_does_not_serve_is_refused_and_leaves_no_stage_behind(folder):
    path, _, _ = folder
    with pytest.raises(ValueError, match="speculative decoding is not served pipeline-parallel"):
        paged_hf.LLM(path, pipeline_parallel_size=2, speculative={"method": "ngram", "num_speculative_tokens": 2},
                     **ENGINE)
    assert not torch.distributed.is_initialized()  # the failed start left its process group


def test_a_stage_refuses_the_kv_tier(folder):
    path, _, _ = folder
    with pytest.raises(ValueError, match="kv_cache_dir / kv_transfer_config are not served pipeline-parallel"):
        paged_hf.LLM(path, pipeline_parallel_size=2, kv_cache_dir=str(folder[0]) + "-kv", **ENGINE)
    assert not torch.distributed.is_initialized()
