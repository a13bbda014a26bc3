"""Speculative decoding with a draft model: outputs are exactly those without it.

Greedy: token for token against plain transformers generate (float64 tiny models), with a smaller random
draft of the same vocabulary (mostly rejected: exercises rollback) and with the model as its own draft (every
draft must be accepted: an off-by-one in positions, catch-up or rollback would show as a rejection). Also
under preemption, chunked prefill and prefix caching, with stop tokens and n > 1. Sampled: seeded requests
give the plain engine's tokens; unseeded ones the model's distribution (chi-square). The draft's own pool
leaks nothing, frees with its requests and hashes only verified tokens.
"""

from __future__ import annotations

import httpx
import pytest
import torch
import transformers
from conftest import FAMILIES, VOCAB, assert_no_leak, hf_greedy, random_prompts, tiny_model
from test_spec_decode import step_to_completion

import paged_hf
from paged_hf import PagedConfig, SamplingParams
from paged_hf.core.kv_cache_manager import hash_block
from paged_hf.core.request import RequestStatus


def small_draft(family: str = "llama", vocab_size: int = VOCAB, seed: int = 5) -> torch.nn.Module:
    """A smaller random model of the family (1 layer, hidden 32) over the same vocabulary."""
    config_name, model_name, extra = FAMILIES[family]
    config = getattr(transformers, config_name)(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=512, **{**extra, **({"head_dim": 16} if "head_dim" in extra else {})})
    torch.manual_seed(seed)
    return getattr(transformers, model_name)(config).to(torch.float64).eval()


def spec(draft, k: int = 4, **extra) -> dict:
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": k, **extra}


def greedy(max_new_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True, **extra)


def assert_draft_pool_free(generator) -> None:
    proposer = generator.speculator.proposer
    assert not proposer.sequences
    assert proposer.block_pool.num_free_blocks == proposer.block_pool.num_blocks
    assert all(block.ref_count == 0 for block in proposer.block_pool.blocks)


def run(model, prompts, params, speculative, **config):
    generator = paged_hf.wrap(model, speculative=speculative, **config).generator
    outputs = generator.generate(prompts, params, use_tqdm=False)
    assert_no_leak(generator)
    assert_draft_pool_free(generator)
    return outputs, generator.stats(), generator


# --- greedy: token for token -----------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "mistral_window", "gemma2"])
def test_greedy_parity_with_a_smaller_draft_and_with_itself(family):
    model = tiny_model(family)
    prompts = random_prompts([9, 21, 30], seed=3)
    expected = [hf_greedy(model, p, 20) for p in prompts]
    outputs, stats, _ = run(model, prompts, greedy(20), spec(small_draft(family)), num_blocks=64)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"], stats  # rollbacks
    outputs, stats, generator = run(model, prompts, greedy(20), spec(model), num_blocks=64)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert stats["spec_decode_num_draft_tokens"] > 20 and stats["spec_decode_acceptance_rate"] == 1.0, stats
    # batched: every engine step with drafts ran 1 catch-up + (k - 1) decode steps for all requests at once
    assert generator.speculator.proposer.num_forward_steps <= 4 * stats["spec_decode_num_drafts"] / 3 + 8


@pytest.mark.parametrize("draft", ["itself", "smaller"])
def test_greedy_parity_under_preemption_chunked_prefill_and_prefix_hits(draft):
    """A pool too small for the batch (preemption), 16-token budget (chunked prefill, and the draft's catch-up
    chunked too), prompts sharing blocks. The model as its own draft still accepts every draft."""
    model = tiny_model("llama")
    a, b, c, d = random_prompts([30, 41, 25, 33], seed=5)
    prompts = [a, b, a[:32] + [7, 8, 9] * 4, c, d, b[:32] + [9, 8] * 6]
    expected = [hf_greedy(model, p, 24) for p in prompts]
    generator = paged_hf.wrap(model, speculative=spec(model if draft == "itself" else small_draft()), num_blocks=40,
                              block_size=4, max_num_batched_tokens=16, max_num_seqs=4).generator
    assert step_to_completion(generator, prompts, greedy(24), _check_draft_state) == expected
    stats = generator.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0, stats
    assert stats["spec_decode_num_draft_tokens"] > 20, stats
    if draft == "itself":
        assert stats["spec_decode_acceptance_rate"] == 1.0, stats
    assert generator.speculator.proposer.prefix_cache_hits > 0  # shared prompts and resumed requests
    assert_no_leak(generator)
    assert_draft_pool_free(generator)


def _check_draft_state(generator, running) -> None:
    """Shadows exist only for running requests, and every hashed block of a shadow holds verified tokens."""
    proposer = generator.speculator.proposer
    size = generator.config.block_size
    blocks = proposer.block_pool.blocks
    for request, sequence in proposer.sequences.items():
        assert request.status is RequestStatus.RUNNING, request.request_id
        if request is not running:
            continue
        shadow = sequence.request
        parent = None
        for i, block_id in enumerate(shadow.block_ids):
            if blocks[block_id].block_hash is None:
                break
            assert (i + 1) * size <= min(shadow.num_computed_tokens, request.num_tokens), (request.request_id, i)
            parent = hash_block(parent, request.all_token_ids[i * size:(i + 1) * size])
            assert blocks[block_id].block_hash == parent, (request.request_id, i)


def test_stop_tokens_and_n():
    model = tiny_model("llama")
    prompts = random_prompts([24, 31], seed=2)
    plain = paged_hf.wrap(model, num_blocks=64).generator.generate(prompts, greedy(20), use_tqdm=False)
    params = [SamplingParams(max_new_tokens=20, temperature=0, stop_token_ids=[plain[0].outputs[0].token_ids[9]]),
              SamplingParams(max_new_tokens=13, temperature=0, n=3)]
    expected = paged_hf.wrap(model, num_blocks=64).generator.generate(prompts, params, use_tqdm=False)
    outputs, stats, _ = run(model, prompts, params, spec(model), num_blocks=64)
    for got, want in zip(outputs, expected):
        assert [(c.token_ids, c.finish_reason) for c in got.outputs] == [(c.token_ids, c.finish_reason) for c in want.outputs]
    assert outputs[0].outputs[0].finish_reason == "stop" and len(outputs[1].outputs) == 3
    assert stats["spec_decode_acceptance_rate"] == 1.0 and stats["spec_decode_num_drafts"] > 0, stats


def test_stop_strings_end_inside_accepted_drafts():
    from conftest import real_tokenizer, tiny_model_for

    tokenizer = real_tokenizer()
    model = tiny_model_for(tokenizer)
    prompt = tokenizer.encode(" hello world, this is a test of the draft model")
    plain = paged_hf.wrap(model, tokenizer, num_blocks=64).generator
    text = plain.generate([prompt], greedy(24), use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    params = SamplingParams(max_new_tokens=24, temperature=0, stop=[stop], logprobs=1)
    want = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    generator = paged_hf.wrap(model, tokenizer, speculative=spec(model), num_blocks=64).generator
    got = generator.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == (want.text, want.token_ids, "stop", stop)
    assert [sorted(e) for e in got.logprobs] == [sorted(e) for e in want.logprobs]
    assert generator.stats()["spec_decode_num_accepted_tokens"] > 0
    assert_draft_pool_free(generator)


# --- sampling ------------------------------------------------------------------------------------------------

def test_seeded_sampling_gives_the_tokens_of_the_plain_engine():
    model = tiny_model("llama")
    prompts = random_prompts([20, 33], seed=1)
    params = [SamplingParams(max_new_tokens=24, temperature=0.3, seed=7, top_k=20, n=2),
              SamplingParams(max_new_tokens=24, temperature=0.5, seed=3, presence_penalty=0.2)]
    expected = paged_hf.wrap(model, num_blocks=64).generator.generate(prompts, params, use_tqdm=False)
    outputs, stats, _ = run(model, prompts, params, spec(model), num_blocks=64)
    assert [[c.token_ids for c in o.outputs] for o in outputs] == [[c.token_ids for c in o.outputs] for o in expected]
    assert stats["spec_decode_num_accepted_tokens"] > 0, stats


def test_sampled_distribution_matches_the_model():
    """Unseeded (token 1, token 2) samples against their exact probabilities (chi-square, vocabulary of 6),
    proposed by another random model of that vocabulary: accepted sometimes, rejected often. The budget lets
    the draft catch up on all 3000 x 10 tokens in one step, so every sample drafts."""
    from test_spec_decode import six_token_model, two_token_chi_square

    chi2, stats = two_token_chi_square(six_token_model(), spec(small_draft(vocab_size=6, seed=2), k=1), budget=32768)
    assert chi2 < 66.6, (chi2, stats)  # 35 degrees of freedom: the 0.999 quantile is ~66.6
    assert stats["spec_decode_num_draft_tokens"] == 3000, stats
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"], stats


# --- its state follows its requests -----------------------------------------------------------------------

def test_abort_frees_the_draft_state_at_once():
    model = tiny_model("llama")
    generator = paged_hf.wrap(model, speculative=spec(model), num_blocks=64).generator
    rid = generator.add_request(random_prompts([40])[0], greedy(30))
    for _ in range(3):
        generator.step()
    proposer = generator.speculator.proposer
    assert proposer.sequences and proposer.block_pool.num_free_blocks < proposer.block_pool.num_blocks
    generator.abort(rid)
    assert_draft_pool_free(generator)
    generator.step()
    assert_no_leak(generator)


def test_policy_without_drafts_never_runs_the_draft_model():
    """disable_by_batch_size=2: three requests that run and end together get no drafts, and the draft model
    never runs; when one ends early, the other two do get drafts."""
    model = tiny_model("llama")
    prompts = random_prompts([12, 14, 16], seed=4)
    _, stats, generator = run(model, prompts, greedy(8), spec(model, disable_by_batch_size=2), num_blocks=64)
    assert stats["spec_decode_num_drafts"] == 0 and generator.speculator.proposer.num_forward_steps == 0
    _, stats, generator = run(model, prompts, [greedy(2), greedy(10), greedy(10)], spec(model, disable_by_batch_size=2),
                              num_blocks=64)
    assert stats["spec_decode_num_drafts"] > 0 and generator.speculator.proposer.num_forward_steps > 0


# --- errors, LoRA, the command line ---------------------------------------------------------------------------

def test_config_errors():
    model = tiny_model("llama")
    for bad, match in [({"method": "draft_model"}, "needs a model"),
                       ({"method": "draft_model", "model": 3}, "folder, a hub id or an HF model"),
                       ({"method": "draft_model", "model": "x", "prompt_lookup_max": 3}, "ngram"),
                       ({"method": "ngram", "model": "x"}, "draft_model")]:
        with pytest.raises(ValueError, match=match):
            PagedConfig(speculative=bad)
    with pytest.raises(ValueError, match=r"vocabulary \(64 tokens\) differs from the model's \(128\)"):
        paged_hf.wrap(model, speculative=spec(small_draft(vocab_size=64)), num_blocks=8)
    with pytest.raises(ValueError, match="could not be loaded"):
        paged_hf.wrap(model, speculative=spec("/nonexistent/draft"), num_blocks=8)


def test_adapter_requests_are_refused_base_requests_served(tmp_path):
    from conftest import LORA_CONFIGS as CONFIGS
    from conftest import make_adapter

    base = tiny_model("llama")
    make_adapter(base, tmp_path / "qv", seed=1, **CONFIGS["qv"])
    generator = paged_hf.wrap(base, speculative=spec(base), num_blocks=64, adapters={"qv": str(tmp_path / "qv")}).generator
    with pytest.raises(ValueError, match="adapter 'qv': .* draft model, which serves base-model requests only"):
        generator.add_request([1, 2, 3], greedy(4), adapter="qv")
    assert generator.stats()["num_waiting"] == 0
    prompt = random_prompts([20], seed=4)[0]
    outputs = generator.generate([prompt], greedy(12), use_tqdm=False)
    assert outputs[0].outputs[0].token_ids == hf_greedy(base, prompt, 12)
    assert generator.stats()["spec_decode_acceptance_rate"] == 1.0


def test_server_refuses_an_adapter_request_with_400(tmp_path):
    from conftest import LORA_CONFIGS as CONFIGS
    from conftest import make_adapter
    from tiny_server import MODEL, serving, tiny_tokenizer

    from paged_hf.serving.openai import ServerSettings, create_app

    base = tiny_model("llama", dtype=torch.float32)
    make_adapter(base, tmp_path / "qv", seed=1, **CONFIGS["qv"])
    generator = paged_hf.wrap(base, tiny_tokenizer(), speculative=spec(base), num_blocks=64, max_model_len=256,
                              adapters={"qv": str(tmp_path / "qv")}).generator
    with serving(create_app(generator, generator.tokenizer, MODEL, ServerSettings())) as url:
        refused = httpx.post(url + "/v1/completions", json={"model": "qv", "prompt": [1, 7, 40], "max_tokens": 4})
        served = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": [1, 7, 40], "max_tokens": 4,
                                                             "temperature": 0})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert "draft model" in error["message"] and error["type"] == "invalid_request_error", error
    assert served.status_code == 200, served.text
    assert_no_leak(generator)


def test_cli_and_bench_take_a_draft_model_path(tmp_path):
    from conftest import real_tokenizer, tiny_model_for

    from paged_hf.bench import sized_engine_config
    from paged_hf.bench.systems import run_system
    from paged_hf.bench.workloads import build_workload
    from paged_hf.entrypoints.cli import build_parser
    from paged_hf.entrypoints.cli_args import engine_config

    tokenizer = real_tokenizer()
    model = tiny_model_for(tokenizer)
    model.save_pretrained(tmp_path / "draft")
    flag = f'{{"method": "draft_model", "model": "{tmp_path / "draft"}", "num_speculative_tokens": 3}}'
    config = engine_config(build_parser().parse_args(["bench", "--speculative-config", flag]))
    assert config["speculative"]["model"] == str(tmp_path / "draft")
    workload = build_workload("grounded", tokenizer, num_requests=2, max_new_tokens_scale=0.05)
    run = run_system("paged_hf_spec", model, tokenizer, workload, sized_engine_config(config, workload))
    assert run.error is None, run.error
    counters = run.extra["spec_decode"]
    assert counters["spec_decode_num_drafts"] > 0 and counters["spec_decode_acceptance_rate"] == 1.0, counters


def test_make_draft_model_example_cuts_the_first_layers():
    """examples/make_draft_model.py: the first N layers of a model, the same weights, served as a draft."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "make_draft_model.py"
    module_spec = importlib.util.spec_from_file_location("make_draft_model", path)
    example = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(example)
    model = tiny_model("llama")
    draft = example.first_layers(model, 1)
    assert draft.config.num_hidden_layers == 1 and len(draft.model.layers) == 1
    assert torch.equal(draft.model.layers[0].mlp.up_proj.weight, model.model.layers[0].mlp.up_proj.weight)
    with pytest.raises(ValueError, match="--layers"):
        example.first_layers(model, 3)
    prompts = random_prompts([15, 22], seed=6)
    outputs, stats, _ = run(model, prompts, greedy(12), spec(draft), num_blocks=64)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(model, p, 12) for p in prompts]
    assert stats["spec_decode_num_drafts"] > 0


@pytest.mark.slow
def test_real_model_float32_as_its_own_draft(loaded):
    """The default model in float32, its own draft: HF's tokens, and (nearly) every draft accepted."""
    model, tokenizer = loaded
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}],
                                           add_generation_prompt=True, tokenize=True, return_dict=False)
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)[0, len(prompt):].tolist()
    generator = paged_hf.wrap(model, tokenizer, speculative=spec(model), num_blocks=64).generator
    output = generator.generate([prompt], SamplingParams(max_new_tokens=20, temperature=0), use_tqdm=False)[0]
    assert output.outputs[0].token_ids == expected
    stats = generator.stats()
    assert stats["spec_decode_acceptance_rate"] >= 0.9, stats
    assert_draft_pool_free(generator)


def test_serve_takes_a_draft_model_folder(tmp_path, monkeypatch, capsys):
    """`paged-hf serve --speculative-config '{"method": "draft_model", "model": PATH}'`; a draft of another
    vocabulary stops the start with its error."""
    pytest.importorskip("uvicorn")
    from tiny_server import tiny_tokenizer

    from paged_hf.entrypoints import cli
    from paged_hf.loader import default_model
    from paged_hf.serving.openai.lifecycle import DrainingServer
    from paged_hf.spec_decode.draft_model import DraftModelProposer

    monkeypatch.setattr(default_model, "load_model",
                        lambda name, dtype, device: (tiny_model("llama", dtype=torch.float32), tiny_tokenizer()))
    result = {}
    monkeypatch.setattr(DrainingServer, "run", lambda self: result.update(app=self.config.app))
    small_draft().to(torch.float32).save_pretrained(tmp_path / "draft")
    small_draft(vocab_size=64).save_pretrained(tmp_path / "other")
    flag = '{"method": "draft_model", "model": "%s", "num_speculative_tokens": 3}'
    assert cli.main(["serve", "--num-blocks", "8", "--speculative-config", flag % (tmp_path / "draft")]) == 0
    generator = result["app"].state.ctx.engine.generator
    assert isinstance(generator.speculator.proposer, DraftModelProposer)
    assert generator.speculator.proposer.info.dtype == torch.float32  # loaded in the model's dtype
    assert cli.main(["serve", "--num-blocks", "8", "--speculative-config", flag % (tmp_path / "other")]) != 0
    assert "vocabulary (64 tokens) differs" in capsys.readouterr().err
