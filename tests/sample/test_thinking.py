"""A thinking model's output in the engine (paged_hf/sample/thinking.py): the thinking is free (plain greedy,
token for token with HF's), the grammar holds from the token after the end marker, and past the budget the
marker is forced. A tiny random float64 Llama over the default model's tokenizer; HF's `generate` is the oracle
of every free stretch."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from conftest import assert_no_leak, real_tokenizer, tiny_model_for

import paged_hf
from paged_hf import SamplingParams
from paged_hf.sample.thinking import ThinkingGate

PROMPT = "Think first, then answer:"
REGEX = r"[0-9]{3}"


@pytest.fixture(scope="module")
def tokenizer():
    return real_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_model_for(tokenizer, 256).double()


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return tokenizer(PROMPT)["input_ids"]


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(ids):].tolist()


def engine(model, tokenizer, prompt, **params) -> paged_hf.CompletionOutput:
    gen = paged_hf.wrap(model, tokenizer=tokenizer, num_blocks=64, max_num_seqs=4).generator
    out = gen.generate([prompt], SamplingParams(temperature=0, **params), use_tqdm=False)[0].outputs[0]
    assert_no_leak(gen)
    return out


def marker(tokenizer) -> list[int]:
    return tokenizer(" Answer:", add_special_tokens=False)["input_ids"]


def test_past_the_budget_the_marker_is_forced_and_the_answer_is_free(model, tokenizer, prompt):
    end = marker(tokenizer)
    free = hf_greedy(model, prompt, 4)
    assert not set(free) & set(end)  # (the model does not write the marker on its own here)
    out = engine(model, tokenizer, prompt, max_new_tokens=12, ignore_eos=True, thinking_end_token_ids=end,
                 thinking_token_budget=4).token_ids
    assert out[:4] == free and out[4:4 + len(end)] == end
    answer_from = 4 + len(end)
    assert out[answer_from:] == hf_greedy(model, prompt + out[:answer_from], 12 - answer_from)


def test_the_grammar_holds_from_the_token_after_the_marker(model, tokenizer, prompt):
    end = marker(tokenizer)
    out = engine(model, tokenizer, prompt, max_new_tokens=20, thinking_end_token_ids=end, thinking_token_budget=3,
                 structured_outputs={"regex": REGEX})
    assert out.token_ids[:3] == hf_greedy(model, prompt, 3) and out.token_ids[3:3 + len(end)] == end
    assert out.finish_reason == "stop"
    assert re.fullmatch(REGEX, tokenizer.decode(out.token_ids[3 + len(end):], skip_special_tokens=True))
    unthinking = engine(model, tokenizer, prompt, max_new_tokens=20, structured_outputs={"regex": REGEX})
    assert re.fullmatch(REGEX, unthinking.text)  # (without the marker: the grammar from the first token)


def test_the_models_own_marker_opens_the_answer(model, tokenizer, prompt):
    """No budget: the thinking ends where the model writes the marker (here: its own third token)."""
    free = hf_greedy(model, prompt, 3)
    out = engine(model, tokenizer, prompt, max_new_tokens=20, thinking_end_token_ids=free[2:3],
                 structured_outputs={"choice": ["yes", "no"]})
    assert out.token_ids[:3] == free and out.finish_reason == "stop"
    assert tokenizer.decode(out.token_ids[3:], skip_special_tokens=True) in ("yes", "no")


def test_the_gate_continues_a_marker_the_model_began_and_rolls_back():
    gate = ThinkingGate([7, 8, 9], budget=3, grammar=None, vocab_size=64)
    for token in (1, 2, 7):  # the model began the marker as the budget ran out
        assert gate.accept(token)
    assert gate.forced_token() == 8
    bitmask = np.full((1, 2), -1, dtype=np.int32)
    gate.fill(bitmask, 0)
    allowed = np.unpackbits(bitmask.view(np.uint8), bitorder="little").nonzero()[0].tolist()
    assert allowed == [8]
    assert not gate.accept(5) and gate.rejected_token == 5
    assert gate.accept(8) and gate.accept(9) and not gate.thinking and gate.num_thinking_tokens == 5
    assert gate.accept(3) and gate.forced_token() is None and not gate.is_terminated
    gate.rollback(2)
    assert gate.thinking and gate.tokens == [1, 2, 7, 8] and gate.forced_token() == 9


def test_bad_thinking_fields_are_refused(model, tokenizer):
    with pytest.raises(ValueError, match="thinking_token_budget"):
        SamplingParams(thinking_token_budget=8)
    with pytest.raises(ValueError, match="thinking_end_token_ids"):
        SamplingParams(thinking_end_token_ids=[])
    gen = paged_hf.wrap(model, tokenizer=tokenizer, num_blocks=16).generator
    with pytest.raises(ValueError, match="thinking_end_token_ids: token id 10000000 is outside the vocabulary"):
        gen.add_request("x", SamplingParams(thinking_end_token_ids=[10_000_000]))
    assert not gen.has_unfinished_requests()


def test_an_optional_thinking_is_opened_by_its_first_token(model, tokenizer, prompt):
    """Magistral's kind: with the start marker first the model thinks (free, HF's tokens) until the end marker;
    without it the grammar holds from the first token. Here the start marker is a token the model writes first
    (its own greedy choice), or its least likely one."""
    free = hf_greedy(model, prompt, 3)
    thinks = engine(model, tokenizer, prompt, max_new_tokens=20, thinking_start_token_id=free[0],
                    thinking_end_token_ids=free[2:3], structured_outputs={"choice": ["yes", "no"]})
    assert thinks.token_ids[:3] == free
    assert tokenizer.decode(thinks.token_ids[3:], skip_special_tokens=True) in ("yes", "no")
    with torch.no_grad():  # a start marker the model would never write first: its least likely token
        unlikely = int(model(torch.tensor([prompt])).logits[0, -1].argmin())
    answers = engine(model, tokenizer, prompt, max_new_tokens=20, thinking_start_token_id=unlikely,
                     thinking_end_token_ids=free[2:3], structured_outputs={"choice": ["yes", "no"]})
    assert answers.text in ("yes", "no") and answers.finish_reason == "stop"


def test_the_gate_decides_on_the_first_token_and_rolls_back_to_undecided():
    gate = ThinkingGate([9], budget=None, grammar=None, vocab_size=64, start_id=7)
    assert gate.undecided and gate.accept(3) and not gate.thinking and gate.answer_from == 0
    gate.rollback(1)
    assert gate.undecided and gate.accept(7) and gate.thinking and gate.accept(9) and not gate.thinking
    with pytest.raises(ValueError, match="thinking_start_token_id"):
        SamplingParams(thinking_start_token_id=7)
