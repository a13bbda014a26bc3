"""Embeddings (`LLM.embed`, `ContinuousBatchGenerator.embed`, `PoolingParams`): equal to sentence-transformers'
`encode` on the same model folder (mean and last-token pooling, normalized), computed as prefill-only requests
in the same packed steps as generation requests, over chunked prefill, the prefix cache and preemption."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers

pytest.importorskip("sentence_transformers")

from conftest import assert_no_leak, hf_greedy, tiny_model  # noqa: E402
from embedding_models import TEXTS, save_embedding_model  # noqa: E402

import paged_hf  # noqa: E402
from paged_hf.engine.embedding import pooling_config_for  # noqa: E402
from paged_hf.loader.pooling_config import read_pooling_config  # noqa: E402
from paged_hf.pooling_params import PoolingParams  # noqa: E402


@pytest.fixture(scope="module", params=["mean", "lasttoken"])
def st_model(request, tmp_path_factory):
    """(folder, the SentenceTransformer oracle, its embeddings of TEXTS)."""
    folder = tmp_path_factory.mktemp("st") / request.param
    oracle = save_embedding_model(folder, request.param)
    return folder, oracle, oracle.encode(TEXTS)


def _vectors(outputs) -> np.ndarray:
    return np.array([output.outputs.embedding for output in outputs])


def test_llm_embed_equals_sentence_transformers(st_model):
    folder, _, expected = st_model
    # 16 tokens a step: the 40-word text is pooled over three chunked-prefill steps
    llm = paged_hf.LLM(str(folder), dtype="float32", device="cpu", num_blocks=64, max_num_batched_tokens=16)
    outputs = llm.embed(TEXTS, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == [llm.tokenizer(t)["input_ids"] for t in TEXTS]
    np.testing.assert_allclose(_vectors(outputs), expected, atol=1e-5)
    assert llm.generator.pooling_config.pooling_type == folder.name and llm.generator.pooling_config.normalize
    # dimensions: Matryoshka truncation, then normalization
    short = llm.embed(TEXTS[:2], PoolingParams(dimensions=8), use_tqdm=False)
    truncated = torch.nn.functional.normalize(torch.tensor(expected[:2, :8]), dim=1).numpy()
    np.testing.assert_allclose(_vectors(short), truncated, atol=1e-5)
    raw = llm.embed(TEXTS[0], PoolingParams(normalize=False), use_tqdm=False)[0].outputs.embedding
    assert abs(np.linalg.norm(raw) - 1) > 1e-3  # not normalized when asked so
    np.testing.assert_allclose(raw / np.linalg.norm(raw), expected[0], atol=1e-5)
    assert_no_leak(llm.generator)


def test_embeddings_share_steps_with_generation(st_model):
    """Embedding and generation requests in the same packed steps; both answers unchanged (generation: HF's
    greedy tokens), prefix-cache blocks shared both ways, no block beyond the prompt."""
    folder, _, expected = st_model
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    gen = paged_hf.wrap(model, tokenizer, num_blocks=64, max_num_batched_tokens=48).generator
    steps = []
    run = gen.runner.run

    def recording_run(out):
        logits, inputs = run(out)
        steps.append((len(inputs.sampled), len(inputs.pooling_spans)))
        return logits, inputs

    gen.runner.run = recording_run
    prompt = tokenizer(TEXTS[4])["input_ids"]  # the prompt of TEXTS[4] is a prefix of none; TEXTS[0]'s is of it
    gen_id = gen.add_request(prompt, paged_hf.SamplingParams(max_new_tokens=6, temperature=0))
    embed_ids = [gen.add_request(text, PoolingParams()) for text in TEXTS]
    results = {}
    while gen.has_unfinished_requests():
        for output in gen.step():
            if output.finished:
                results[output.request_id] = output
    assert any(num_sampled and num_pooled for num_sampled, num_pooled in steps), steps
    assert results[gen_id].outputs[0].token_ids == hf_greedy(model, prompt, 6)
    np.testing.assert_allclose(_vectors([results[i] for i in embed_ids]), expected, atol=1e-5)
    hits = gen.stats()["prefix_cache_hits"]
    again = gen.embed(TEXTS[4])  # its first two blocks are cached (by the generation request)
    np.testing.assert_allclose(_vectors(again)[0], expected[4], atol=1e-5)
    # last-token pooling reads the cache; mean pooling reads every token, so computes them all
    assert (gen.stats()["prefix_cache_hits"] > hits) == (folder.name == "lasttoken")
    assert_no_leak(gen)


def test_embeddings_survive_preemption(st_model):
    """A cache too small for everything at once: requests are preempted and recomputed; vectors unchanged."""
    folder, _, expected = st_model
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    gen = paged_hf.wrap(model, tokenizer, num_blocks=10, block_size=8, max_num_batched_tokens=16).generator
    params = paged_hf.SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    prompts = [tokenizer(t)["input_ids"] for t in (TEXTS[2], TEXTS[4])]
    outputs = gen.generate(prompts + TEXTS, [params] * 2 + [PoolingParams()] * len(TEXTS), use_tqdm=False)
    assert gen.stats()["num_preemptions"] > 0
    np.testing.assert_allclose(_vectors(outputs[2:]), expected, atol=1e-5)
    assert_no_leak(gen)


def test_decoder_without_config_pools_last_token():
    model = tiny_model("llama", dtype=torch.float32)
    gen = paged_hf.wrap(model, num_blocks=32).generator
    prompt = list(range(3, 30))
    vector = gen.embed(prompt)[0].outputs.embedding
    hidden = model.model(torch.tensor([prompt])).last_hidden_state[0, -1]
    np.testing.assert_allclose(vector, torch.nn.functional.normalize(hidden, dim=0).detach().numpy(), atol=1e-5)
    assert gen.pooling_config.pooling_type == "lasttoken"


def test_bad_embedding_requests_are_refused():
    gen = paged_hf.wrap(tiny_model("llama", dtype=torch.float32), num_blocks=4, block_size=16,
                        max_model_len=100).generator
    for params, prompt, message in [(PoolingParams(dimensions=65), [5], "dimensions=65"),
                                    (PoolingParams(), [], "empty"),
                                    (PoolingParams(), [5] * 101, "max_model_len"),
                                    (PoolingParams(), [5] * 65, "KV blocks"),
                                    (PoolingParams(), [500], "outside the vocabulary")]:
        with pytest.raises(ValueError, match=message):
            gen.add_request(prompt, params)
    with pytest.raises(ValueError, match="embed"):
        gen.stream([5], PoolingParams())
    for field in ({"dimensions": 0}, {"dimensions": True}, {"normalize": "yes"}):
        with pytest.raises(ValueError, match=next(iter(field))):
            PoolingParams(**field)
    assert not gen.has_unfinished_requests()


def test_encoders_are_refused():
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64)
    with pytest.raises(ValueError, match="encoder"):
        pooling_config_for(transformers.BertModel(config))


def test_sentence_transformers_configs(tmp_path):
    def folder(modules, pooling):
        (tmp_path / "1_Pooling").mkdir(exist_ok=True)
        (tmp_path / "modules.json").write_text(json.dumps(
            [{"idx": i, "path": path, "type": f"sentence_transformers.models.{kind}"}
             for i, (kind, path) in enumerate(modules)]))
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
        return tmp_path

    plain = [("Transformer", ""), ("Pooling", "1_Pooling")]
    legacy = {"word_embedding_dimension": 64, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}
    config = read_pooling_config(folder(plain, legacy))
    assert (config.pooling_type, config.normalize) == ("cls", False)
    config = read_pooling_config(folder(plain + [("Normalize", "2_Normalize")], {"pooling_mode": "mean"}))
    assert (config.pooling_type, config.normalize) == ("mean", True)
    for modules, pooling, message in [(plain + [("Dense", "2_Dense")], {"pooling_mode": "mean"}, "Dense"),
                                      (plain, {"pooling_mode": "weightedmean"}, "weightedmean"),
                                      (plain, {"pooling_mode": ["mean", "max"]}, "not supported"),
                                      (plain, {"pooling_mode": "mean", "include_prompt": False}, "include_prompt")]:
        with pytest.raises(ValueError, match=message):
            read_pooling_config(folder(modules, pooling))
    assert read_pooling_config(tmp_path / "nowhere") is None
