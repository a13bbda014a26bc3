"""The drop-in `generate(num_beams=k)` against HF's own beam search with the same arguments: equal outputs."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_no_leak, random_prompts, tiny_model

import paged_hf
from paged_hf.engine import beam_search

PAD = 0
PROMPTS = random_prompts([5, 9, 3], seed=1)


def left_padded(prompts):
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


@pytest.fixture
def model():
    return tiny_model("llama", seed=2)


@pytest.fixture
def paged(model, monkeypatch):
    paged = paged_hf.wrap(model, num_blocks=256, block_size=4, max_num_batched_tokens=32)
    calls = []
    original = beam_search.run_beam_searches
    monkeypatch.setattr(beam_search, "run_beam_searches", lambda *a, **k: calls.append(a[2]) or original(*a, **k))
    monkeypatch.setattr("paged_hf.hf.beam_generate.run_beam_searches", beam_search.run_beam_searches)
    paged.beam_calls = calls  # the BeamSearchParams of every call served by the engine (no fallback)
    yield paged
    assert_no_leak(paged.generator)


def assert_same_output(expected, got):
    if isinstance(expected, torch.Tensor):
        assert got.dtype == expected.dtype and torch.equal(got, expected), (expected, got)
        return
    assert type(got) is type(expected)
    for name in ("sequences", "sequences_scores", "beam_indices", "scores", "logits"):
        want, have = getattr(expected, name), getattr(got, name)
        if isinstance(want, tuple):
            assert isinstance(have, tuple) and len(have) == len(want), name
            for w, h in zip(want, have):
                assert torch.equal(w, h), name
        elif want is None:
            assert have is None, name
        else:
            assert have.dtype == want.dtype and torch.equal(have, want), (name, want, have)


def eos_in_beams(model, ids, mask, width) -> list[int]:
    """Tokens HF's beams produce (with them as EOS, hypotheses end inside the search and rows get filled)."""
    out = model.generate(ids, attention_mask=mask, num_beams=width, max_new_tokens=10, pad_token_id=PAD,
                         eos_token_id=None)
    generated = out[:, ids.shape[1]:]
    return sorted({generated[0, 3].item(), generated[-1, 6].item()})


@pytest.mark.parametrize("width,nrs,length_penalty,early_stopping", [
    (2, 1, 1.0, False), (4, 3, 0.5, True), (8, 2, 2.0, "never"), (5, 5, -1.0, False)])
def test_padded_batch_with_eos_matches_hf(model, paged, width, nrs, length_penalty, early_stopping):
    ids, mask = left_padded(PROMPTS)
    eos = eos_in_beams(model, ids, mask, width)
    kwargs = dict(attention_mask=mask, num_beams=width, num_return_sequences=nrs, max_new_tokens=10,
                  length_penalty=length_penalty, early_stopping=early_stopping, eos_token_id=eos, pad_token_id=PAD)
    expected = model.generate(ids, **kwargs)
    assert_same_output(expected, paged.generate(ids, **kwargs))
    assert expected.shape[0] == 3 * nrs and len(paged.beam_calls) == 1
    assert not torch.equal(expected, model.generate(ids, **{**kwargs, "eos_token_id": None}))  # EOS mattered


@pytest.mark.parametrize("outputs", [{}, {"output_scores": True}, {"output_logits": True, "output_scores": True}])
def test_return_dict_matches_hf(model, paged, outputs):
    """sequences, sequences_scores, beam_indices and the per-round scores/logits (HF's batch runs until every
    prompt is done; so does the engine's BeamCohort)."""
    ids, mask = left_padded(PROMPTS)
    eos = eos_in_beams(model, ids, mask, 3)
    kwargs = dict(attention_mask=mask, num_beams=3, num_return_sequences=2, max_new_tokens=10, eos_token_id=eos,
                  pad_token_id=PAD, return_dict_in_generate=True, **outputs)
    expected = model.generate(ids, **kwargs)
    assert_same_output(expected, paged.generate(ids, **kwargs))
    assert len(paged.beam_calls) == 1


def test_pad_zero_fills_with_eos_and_min_length(model, paged):
    """HF fills ended rows with `pad_token_id or eos_token_id[0]`; min_new_tokens masks EOS in every beam."""
    ids, mask = left_padded(PROMPTS)
    eos = eos_in_beams(model, ids, mask, 4)
    for extra in ({}, {"min_new_tokens": 6}, {"repetition_penalty": 1.2}):
        kwargs = dict(num_beams=4, max_new_tokens=10, eos_token_id=eos, pad_token_id=PAD, **extra)
        if "repetition_penalty" in extra:  # HF penalizes pad tokens: unpadded rows only
            expected = model.generate(ids[1:2], **kwargs)
            assert_same_output(expected, paged.generate(ids[1:2], **kwargs))
        else:
            expected = model.generate(ids, attention_mask=mask, **kwargs)
            assert_same_output(expected, paged.generate(ids, attention_mask=mask, **kwargs))
    assert len(paged.beam_calls) == 3


@pytest.mark.parametrize("kwargs", [{"do_sample": True}, {"num_beam_groups": 2, "diversity_penalty": 0.5},
                                    {"output_attentions": True, "return_dict_in_generate": True},
                                    {"num_return_sequences": 5}])
def test_what_the_engine_cannot_serve_goes_to_hf(model, paged, kwargs):
    ids, mask = left_padded(PROMPTS)
    call = dict(attention_mask=mask, num_beams=4, max_new_tokens=6, pad_token_id=PAD, **kwargs)
    try:
        torch.manual_seed(0)
        expected = model.generate(ids, **call)
    except Exception as error:  # noqa: BLE001 - HF refuses it: so must the drop-in, with HF's error
        with pytest.raises(type(error)):
            paged.generate(ids, **call)
    else:
        torch.manual_seed(0)
        got = paged.generate(ids, **call)
        assert_same_output(expected.sequences if hasattr(expected, "sequences") else expected,
                           got.sequences if hasattr(got, "sequences") else got)
    assert paged.beam_calls == []
