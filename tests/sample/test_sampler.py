"""The sampler against HF's logits processors, the softmax it should sample from, and its seeding contract."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from paged_hf.sample.sampler import (
    Sampler,
    SamplerOutput,
    SamplingRow,
    _apply_presence_frequency,
    _probabilities,
    make_rng,
)
from paged_hf.sampling_params import SamplingParams

EOS = 3


def row(params: SamplingParams | None = None, prompt=(0, 1), output=(), rng=None) -> SamplingRow:
    return SamplingRow(params or SamplingParams(), list(prompt), list(output), rng)


def greedy(**fields) -> SamplingParams:
    return SamplingParams(temperature=0.0, **fields)


# --- greedy -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_greedy_is_argmax_also_among_sampled_rows(dtype):
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)).to(dtype)
    out = Sampler([EOS])(logits, [row(greedy()) for _ in range(6)])
    assert out.token_ids == logits.argmax(-1).tolist() and out.logprobs == [None] * 6
    # Same rows with sampled neighbours and a logprobs request: the slow path must agree.
    # top_k=1 rows are sampled yet deterministic: each row must get its own row's top token back.
    rows = [row(greedy()), row(SamplingParams(top_k=1)), row(greedy(logprobs=2)), row(SamplingParams(top_k=1)),
            row(greedy()), row(SamplingParams(top_k=1))]
    out = Sampler([EOS])(logits, rows)
    assert out.token_ids == logits.float().argmax(-1).tolist()
    assert all(isinstance(t, int) for t in out.token_ids)


def test_greedy_ties_take_the_lowest_index():
    logits = torch.zeros(2, 10)
    logits[:, [4, 7]] = 5.0
    out = Sampler([])(logits, [row(greedy()), row(greedy(logprobs=1))])
    assert out.token_ids == [4, 4]
    assert out.logprobs[0] is None and set(out.logprobs[1]) == {4}  # the all-greedy batch still reports logprobs


def test_logits_are_not_modified_in_place():
    logits = torch.randn(3, 40)
    before = logits.clone()
    rows = [row(greedy(repetition_penalty=1.5, min_new_tokens=2), output=[5, 6]),
            row(SamplingParams(temperature=0.5, top_k=4, top_p=0.8, min_p=0.1, presence_penalty=1.0), output=[1]),
            row(SamplingParams(frequency_penalty=1.0, logprobs=3), output=[2, 2])]
    Sampler([EOS])(logits, rows)
    assert torch.equal(logits, before)


# --- penalties --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("penalty", [1.3, 0.7, 2.5])
def test_repetition_penalty_matches_hf_then_argmax(penalty):
    gen = torch.Generator().manual_seed(1)
    num_rows, vocab_size = 64, 30
    logits = torch.randn(num_rows, vocab_size, generator=gen) * 2
    ids = torch.randint(0, vocab_size, (num_rows, 12), generator=gen)  # 8 prompt + 4 output tokens per row
    expected = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone()).argmax(-1)
    rows = [row(greedy(repetition_penalty=penalty), ids[i, :8].tolist(), ids[i, 8:].tolist()) for i in range(num_rows)]
    tokens = torch.tensor(Sampler([])(logits, rows).token_ids)
    assert torch.equal(tokens, expected)
    assert not torch.equal(tokens, logits.argmax(-1))  # the penalty did change some choices


def test_repetition_penalty_is_per_row():
    logits = torch.tensor([[2.0, 1.9, 0.0], [2.0, 1.9, 0.0]])
    rows = [row(greedy(repetition_penalty=2.0), prompt=[0]), row(greedy(), prompt=[0])]
    assert Sampler([])(logits, rows).token_ids == [1, 0]


def test_presence_and_frequency_penalties_change_the_right_logits():
    logits = torch.randn(3, 10)
    rows = [row(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), prompt=[7, 7], output=[1, 1, 1, 4]),
            row(SamplingParams(), output=[1, 2]),  # no penalty: untouched
            row(SamplingParams(frequency_penalty=-1.0), output=[9])]
    expected = logits.clone()
    expected[0, 1] -= 0.5 + 0.25 * 3
    expected[0, 4] -= 0.5 + 0.25 * 1
    expected[2, 9] += 1.0  # token 7 only in the prompt: not penalized
    torch.testing.assert_close(_apply_presence_frequency(logits, rows), expected)
    # Through the public call: the penalty moves greedy off the repeated token.
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    assert Sampler([])(logits, [row(greedy(presence_penalty=1.5), output=[0])]).token_ids == [1]
    assert Sampler([])(logits, [row(greedy(frequency_penalty=0.4), output=[0, 0])]).token_ids == [0]
    assert Sampler([])(logits, [row(greedy(frequency_penalty=0.4), output=[0, 0, 0])]).token_ids == [1]


def test_min_new_tokens_masks_eos_and_stop_ids():
    logits = torch.full((1, 10), 0.0)
    logits[0, EOS], logits[0, 5], logits[0, 8], logits[0, 2] = 9.0, 8.0, 7.0, 6.0  # EOS > stop 5 > extra EOS 8 > 2
    sampler = Sampler([EOS])
    params = greedy(min_new_tokens=2, stop_token_ids=[5], eos_token_ids=[8], max_new_tokens=4)
    assert sampler(logits, [row(params, output=[1])]).token_ids == [2]
    assert sampler(logits, [row(params, output=[1, 1])]).token_ids == [EOS]  # enough tokens: nothing masked
    ignore = greedy(min_new_tokens=2, stop_token_ids=[5], ignore_eos=True)
    assert sampler(logits, [row(ignore, output=[])]).token_ids == [EOS]  # ignore_eos: EOS is a plain token
    logits[0, EOS] = -1.0
    assert sampler(logits, [row(ignore, output=[])]).token_ids == [8]  # ...but stop ids stay masked
    # Sampling with the stopping tokens far ahead: never drawn, across many rows.
    hot = torch.zeros(500, 10)
    hot[:, [EOS, 5]] = 30.0
    tokens = sampler(hot, [row(SamplingParams(min_new_tokens=1, stop_token_ids=[5]))] * 500).token_ids
    assert not {EOS, 5} & set(tokens)


# --- sampling distribution and filters --------------------------------------------------------------------


def _hf_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> torch.Tensor:
    scores, ids = logits[None].clone(), torch.zeros(1, 1, dtype=torch.long)
    warpers = [TemperatureLogitsWarper(temperature)] + ([TopKLogitsWarper(top_k)] if top_k else [])
    warpers += [TopPLogitsWarper(top_p)] if top_p < 1 else []
    warpers += [MinPLogitsWarper(min_p)] if min_p else []
    for warper in warpers:
        scores = warper(ids, scores)
    return scores.softmax(-1)[0]


@pytest.mark.parametrize("fields", [{"temperature": 0.7}, {"temperature": 1.0},
                                    {"temperature": 1.5, "top_k": 5, "top_p": 0.9}, {"temperature": 0.8, "min_p": 0.2}])
def test_frequencies_match_the_target_distribution(fields):
    torch.manual_seed(0)
    logits = torch.tensor([1.0, 0.5, 2.0, -1.0, 0.0, 1.5, -0.5, 0.8])
    num_draws = 20000
    tokens = Sampler([])(logits.expand(num_draws, -1), [row(SamplingParams(**fields))] * num_draws).token_ids
    freq = torch.bincount(torch.tensor(tokens), minlength=8) / num_draws
    expected = _hf_probs(logits, **fields)
    assert (freq - expected).abs().max() < 0.02, (freq, expected)
    assert torch.all(freq[expected == 0] == 0)


def test_a_seeded_stream_samples_the_right_distribution():
    logits = torch.tensor([[1.0, 0.5, 2.0, -1.0, 0.0, 1.5, -0.5, 0.8]])
    sampler, rng = Sampler([]), make_rng(7, 0, "cpu")
    rows = [row(SamplingParams(temperature=0.7), rng=rng)]
    tokens = [sampler(logits, rows).token_ids[0] for _ in range(4000)]
    freq = torch.bincount(torch.tensor(tokens), minlength=8) / len(tokens)
    assert (freq - (logits[0] / 0.7).softmax(-1)).abs().max() < 0.035


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), top_k=st.sampled_from([0, -1, 1, 2, 7, 40]),
       top_p=st.sampled_from([1.0, 0.95, 0.5, 0.1]), min_p=st.sampled_from([0.0, 0.05, 0.3]),
       temperature=st.sampled_from([0.3, 1.0, 2.0]))
def test_filters_never_draw_outside_hfs_kept_set(seed, top_k, top_p, min_p, temperature):
    gen = torch.Generator().manual_seed(seed)
    num_rows, vocab_size = 256, 40
    logits = torch.randn(num_rows, vocab_size, generator=gen) * 3
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    for warper in ([TopKLogitsWarper(top_k)] if top_k > 0 else []) + [TopPLogitsWarper(top_p), MinPLogitsWarper(min_p)]:
        scores = warper(None, scores)
    kept = scores > float("-inf")
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    # Rows interleaved with unfiltered ones: each row's filter must use its own params.
    rows = [row(params if i % 2 == 0 else SamplingParams()) for i in range(num_rows)]
    tokens = torch.tensor(Sampler([])(logits, rows).token_ids)
    assert kept[torch.arange(0, num_rows, 2), tokens[::2]].all()
    if top_k > 0:
        assert (kept.sum(-1) <= top_k).all()


def test_top_k_keeps_exactly_the_top_k_and_top_p_the_nucleus():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]]).expand(3000, -1)
    tokens = set(Sampler([])(logits, [row(SamplingParams(top_k=3, temperature=5.0))] * 3000).token_ids)
    assert tokens == {0, 1, 2}
    probs = logits[0].softmax(-1)  # ~ [.63, .23, .09, .03, ...]: 0.9 needs the first three tokens
    assert probs[:2].sum() < 0.9 < probs[:3].sum()
    tokens = set(Sampler([])(logits, [row(SamplingParams(top_p=0.9))] * 3000).token_ids)
    assert tokens == {0, 1, 2}
    tokens = set(Sampler([])(logits, [row(SamplingParams(top_p=0.01))] * 3000).token_ids)
    assert tokens == {0}  # always at least one token...
    tokens = set(Sampler([])(logits.flip(-1), [row(SamplingParams(top_p=1e-9))] * 3000).token_ids)
    assert tokens == {5}  # ...even where 1 - top_p rounds to 1


# --- seeding ------------------------------------------------------------------------------------------------


def _seeded_run(position: int, num_rows: int, num_steps: int = 5) -> list[int]:
    """The tokens of the seeded row (seed 1234) at `position` among random rows, over a few steps."""
    target = make_rng(1234, 0, "cpu")
    others = [make_rng(99 + i, 0, "cpu") if i % 3 == 0 else None for i in range(num_rows)]
    sampler, tokens = Sampler([]), []
    for step in range(num_steps):
        logits = torch.randn(num_rows, 100)  # the neighbours' logits change between runs
        logits[position] = torch.linspace(-2, 2, 100) + step * 0.1
        rows = [row(SamplingParams(temperature=1.3), rng=target if i == position else others[i])
                for i in range(num_rows)]
        tokens.append(sampler(logits, rows).token_ids[position])
    return tokens


def test_seeded_row_gives_the_same_tokens_whatever_the_batch():
    alone = _seeded_run(0, 1)
    for position, num_rows in [(0, 8), (3, 8), (7, 8), (20, 33)]:
        torch.manual_seed(position)  # a different global RNG state too
        assert _seeded_run(position, num_rows) == alone


def test_make_rng_streams_differ_by_index_and_reproduce():
    def draws(seed, index):
        return torch.rand(8, generator=make_rng(seed, index, "cpu"))

    assert torch.equal(draws(5, 0), draws(5, 0)) and torch.equal(draws(5, 3), draws(5, 3))
    children = [draws(5, i) for i in range(6)]
    assert all(not torch.equal(children[i], children[j]) for i in range(6) for j in range(i))
    assert not torch.equal(draws(5, 0), draws(6, 0))
    assert not torch.equal(draws(1, 0), draws(1 + 2**32, 0))  # CPU keeps 32 bits of a seed
    draws(-1, 0), draws(2**80, 2)  # any int is a valid seed


# --- logprobs -----------------------------------------------------------------------------------------------


def test_logprobs_hold_the_sampled_token_and_the_raw_top_k():
    logits = torch.randn(4, 30, dtype=torch.float32)
    rows = [row(SamplingParams(logprobs=3, temperature=0.5, top_k=10, repetition_penalty=1.4), output=[1, 2]),
            row(greedy(logprobs=0)),
            row(SamplingParams()),
            row(greedy(logprobs=5, min_new_tokens=1), output=[])]
    logits[3, logits[3].argmax()] = 50.0
    logits[3, EOS] = 100.0  # masked by min_new_tokens, yet it is the top raw logprob
    out: SamplerOutput = Sampler([EOS])(logits, rows)
    raw = logits.log_softmax(-1)
    assert out.logprobs[2] is None
    assert out.logprobs[1] == {out.token_ids[1]: pytest.approx(raw[1, out.token_ids[1]].item())}
    for i, k in [(0, 3), (3, 5)]:
        entry = out.logprobs[i]
        top = set(raw[i].topk(k).indices.tolist())
        assert set(entry) == top | {out.token_ids[i]}
        for token, value in entry.items():
            assert math.isclose(value, raw[i, token].item(), rel_tol=1e-5, abs_tol=1e-6)
    assert out.token_ids[3] != EOS and EOS in out.logprobs[3]


# --- no accepted parameters give NaN or inf probabilities --------------------------------------------------

VOCAB_SIZE = 24
positive = dict(allow_nan=False, allow_infinity=False, allow_subnormal=True)


@st.composite
def sampling_rows(draw) -> SamplingRow:
    """Any SamplingParams inside the accepted ranges, with extreme values favoured, over prompt/output ids."""
    temperature = draw(st.one_of(st.sampled_from([0.0, 5e-324, 1e-45, 1e-8, 1e-5, 1.0, 1e300]),
                                 st.floats(min_value=0, max_value=1e308, **positive)))
    penalty = draw(st.one_of(st.sampled_from([5e-324, 1e-300, 1e-45, 0.5, 1.0, 2.0, 1e300, 1.7e308]),
                             st.floats(min_value=0, max_value=1.7e308, exclude_min=True, **positive)))
    max_new_tokens = draw(st.integers(1, 8))
    params = SamplingParams(
        max_new_tokens=max_new_tokens, min_new_tokens=draw(st.integers(0, max_new_tokens)),
        temperature=temperature, top_p=draw(st.sampled_from([1.0, 0.5, 1e-9, 5e-324])),
        top_k=draw(st.sampled_from([-1, 0, 1, 3, VOCAB_SIZE, VOCAB_SIZE + 5])),
        min_p=draw(st.sampled_from([0.0, 0.1, 1.0])), repetition_penalty=penalty,
        presence_penalty=draw(st.sampled_from([-2.0, 0.0, 2.0])), frequency_penalty=draw(st.sampled_from([-2.0, 0.0, 2.0])),
        stop_token_ids=draw(st.sampled_from([None, [0], list(range(VOCAB_SIZE))])),
        ignore_eos=draw(st.booleans()),
    )
    ids = st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=VOCAB_SIZE)
    prompt = draw(ids.filter(bool) | st.just(list(range(VOCAB_SIZE))))
    return row(params, prompt=prompt, output=draw(ids))


@settings(max_examples=300, deadline=None)
@given(rows=st.lists(sampling_rows(), min_size=1, max_size=4), scale=st.sampled_from([1.0, 1e4, 1e30]),
       dtype=st.sampled_from([torch.float32, torch.float64]), seed=st.integers(0, 2**31))
def test_no_accepted_parameters_give_nan_or_inf_probabilities(rows, scale, dtype, seed):
    logits = (torch.randn(len(rows), VOCAB_SIZE, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)
    sampler = Sampler([EOS])
    scores = sampler.penalized(logits.to(dtype), rows)
    assert not scores.isnan().any() and (scores > float("-inf")).any(dim=-1).all()
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    probs = torch.zeros_like(scores)
    if sampled:
        probs[sampled] = _probabilities(scores[sampled], [rows[i] for i in sampled])
    assert probs.isfinite().all() and (probs >= 0).all() and (probs[sampled].sum(dim=-1) > 0).all(), probs
    tokens = sampler(logits, rows).token_ids
    for i, (token, r) in enumerate(zip(tokens, rows)):
        if r.params.greedy:
            assert token == scores[i].argmax().item()
        else:
            assert probs[i, token] > 0, (r.params, probs[i])


def test_a_temperature_below_1e_5_is_greedy():
    logits = torch.tensor([[1.0, 3.0, 2.0]]).expand(200, -1)
    for temperature in (1e-45, 5e-324, 9.9e-6):
        assert SamplingParams(temperature=temperature).greedy
        assert set(Sampler([])(logits, [row(SamplingParams(temperature=temperature))] * 200).token_ids) == {1}
    assert not SamplingParams(temperature=1e-5).greedy
