"""`PagedModel.generate` against HF's `model.generate` with the same arguments: equal tensors, or the same error."""

from __future__ import annotations

import logging
import string

import pytest
import torch
import transformers.utils.logging as hf_logging
from conftest import assert_no_leak, random_prompts, tiny_model
from transformers import GenerationConfig, PreTrainedTokenizerFast
from transformers.generation.streamers import BaseStreamer
from transformers.generation.utils import GenerateDecoderOnlyOutput

import paged_hf

PAD = 0
MAX_NEW = 12


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def right_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([p + [PAD] * (width - len(p)) for p in prompts])
    mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in prompts])
    return ids, mask


BATCH = left_padded(random_prompts([5, 9, 3], seed=1))


def wrap(model, **config):
    return paged_hf.wrap(model, **{"num_blocks": 64, "block_size": 4, "max_num_batched_tokens": 16, **config})


@pytest.fixture
def model():
    return tiny_model("llama")


@pytest.fixture
def paged(model):
    paged = wrap(model)
    yield paged
    assert_no_leak(paged.generator)
    assert not paged.generator.has_unfinished_requests()  # aborted stop-string rows were delivered too


@pytest.fixture
def engine_calls(paged, monkeypatch):
    """The SamplingParams of every call that reached the engine (proves no fallback happened)."""
    calls = []
    original = paged.generator.generate

    def spy(prompts, sampling_params=None, **kwargs):
        calls.append(sampling_params)
        return original(prompts, sampling_params, **kwargs)

    monkeypatch.setattr(paged.generator, "generate", spy)
    return calls


def assert_same(model, paged, *args, **kwargs) -> torch.Tensor:
    expected = model.generate(*args, **kwargs)
    got = paged.generate(*args, **kwargs)
    assert got.shape == expected.shape and torch.equal(got, expected), (expected, got)
    return expected


def free_run(model, ids, mask) -> torch.Tensor:
    """[batch, MAX_NEW]: what greedy produces when nothing stops it."""
    out = model.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=None, pad_token_id=PAD)
    return out[:, ids.shape[1]:]


def early_eos(generated: torch.Tensor) -> int:
    """A token row 0 produces within its first 3 tokens and some other row never produces: with it as EOS,
    row 0 stops early while another row runs to the end, so row 0 is padded."""
    for token in generated[0, :3].tolist():
        if any(token not in row.tolist() for row in generated[1:]):
            return token
    raise AssertionError(f"no usable EOS in {generated}")


@pytest.mark.parametrize("eos_kind, with_pad", [("int", True), ("list", True), ("int", False)])
def test_left_padded_batch_with_early_eos(model, paged, engine_calls, eos_kind, with_pad):
    ids, mask = BATCH
    eos = early_eos(free_run(model, ids, mask))
    kwargs = {"eos_token_id": eos if eos_kind == "int" else [127, eos]}
    if with_pad:
        kwargs["pad_token_id"] = PAD
    out = assert_same(model, paged, ids, attention_mask=mask, max_new_tokens=MAX_NEW, **kwargs)
    assert out.shape[1] == ids.shape[1] + MAX_NEW  # a row ran to the end ...
    row0 = out[0, ids.shape[1]:].tolist()
    stop = row0.index(eos)
    assert stop < 3 and row0[stop + 1:] == [PAD if with_pad else eos] * (MAX_NEW - stop - 1)  # ... row 0 is padded
    assert len(engine_calls) == 1


def test_explicit_eos_replaces_the_models_own(model):
    """HF uses exactly the eos_token_id given; the model's own EOS (which the engine knows) must not stop it."""
    ids, mask = BATCH
    generated = free_run(model, ids, mask)
    model_eos = generated[0, 1].item()
    model.generation_config.eos_token_id = model_eos
    paged = wrap(model)
    user_eos = early_eos(generated[[1, 0, 2]])  # a token of row 1, so row 0 runs past its model_eos
    for kwargs in ({"eos_token_id": user_eos}, {}):
        assert_same(model, paged, ids, attention_mask=mask, max_new_tokens=MAX_NEW, pad_token_id=PAD, **kwargs)
    assert_no_leak(paged.generator)


def test_mask_inferred_from_pad_token(model, paged, engine_calls):
    """Without attention_mask HF infers it from pad_token_id (when it differs from EOS)."""
    ids, _ = BATCH
    assert_same(model, paged, ids, max_new_tokens=6, pad_token_id=PAD, eos_token_id=1)
    assert_same(model, paged, input_ids=ids[1:2], max_new_tokens=6)
    assert len(engine_calls) == 2


def test_right_padding_matches_hf(model, paged):
    ids, mask = right_padded(random_prompts([5, 9, 3], seed=1))
    assert_same(model, paged, ids, attention_mask=mask, max_new_tokens=8, pad_token_id=PAD)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_max_length_and_default_length(model, paged, engine_calls):
    ids, mask = BATCH
    assert_same(model, paged, ids, attention_mask=mask, max_length=ids.shape[1] + 7, pad_token_id=PAD)
    out = assert_same(model, paged, ids, attention_mask=mask, pad_token_id=PAD)  # HF's default: 20 new tokens
    assert out.shape[1] == ids.shape[1] + 20
    assert [p.max_new_tokens for p in engine_calls[0] + engine_calls[1]] == [7] * 3 + [20] * 3


@pytest.mark.parametrize("length_kwarg", ["min_new_tokens", "min_length"])
def test_min_new_tokens_and_min_length(model, paged, engine_calls, length_kwarg):
    ids, mask = BATCH
    eos = early_eos(free_run(model, ids, mask))
    minimum = 6 if length_kwarg == "min_new_tokens" else ids.shape[1] + 6
    out = assert_same(model, paged, ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos,
                      pad_token_id=PAD, **{length_kwarg: minimum})
    assert eos not in out[0, ids.shape[1]:ids.shape[1] + 6].tolist()
    assert engine_calls[0][0].min_new_tokens == 6


def test_repetition_penalty(model, paged, engine_calls):
    ids, mask = left_padded(random_prompts([7, 7, 7], seed=1))  # no padding: the engine serves it
    assert_same(model, paged, ids, attention_mask=mask, max_new_tokens=MAX_NEW, repetition_penalty=1.3, pad_token_id=PAD)
    assert len(engine_calls) == 1


def test_repetition_penalty_on_a_padded_batch_is_left_to_hf(model, paged, engine_calls):
    """HF's penalty also counts a padded row's pad tokens as seen; the engine never sees padding, so HF answers."""
    ids, mask = BATCH
    assert_same(model, paged, ids, attention_mask=mask, max_new_tokens=MAX_NEW, repetition_penalty=1.3, pad_token_id=PAD)
    assert engine_calls == []


def test_num_return_sequences(model, paged, engine_calls):
    ids, mask = BATCH
    with pytest.raises(ValueError) as hf_error:  # transformers 5 refuses it for greedy decoding
        model.generate(ids, attention_mask=mask, max_new_tokens=4, num_return_sequences=2)
    with pytest.raises(ValueError) as our_error:
        paged.generate(ids, attention_mask=mask, max_new_tokens=4, num_return_sequences=2)
    assert str(our_error.value) == str(hf_error.value)
    # sampling from the single top token is deterministic: each prompt's rows are contiguous duplicates
    out = assert_same(model, paged, ids, attention_mask=mask, max_new_tokens=6, do_sample=True, top_k=1,
                      num_return_sequences=2, pad_token_id=PAD)
    assert out.shape[0] == 6 and torch.equal(out[0::2], out[1::2])
    assert engine_calls[0][0].n == 2


def test_return_dict_in_generate(model, paged, engine_calls):
    ids, mask = BATCH
    kwargs = {"attention_mask": mask, "max_new_tokens": 5, "pad_token_id": PAD, "return_dict_in_generate": True}
    for extra in ({"output_scores": False, "use_cache": False}, {"output_scores": True}):  # scores: HF's own
        expected, got = model.generate(ids, **kwargs, **extra), paged.generate(ids, **kwargs, **extra)
        assert isinstance(got, GenerateDecoderOnlyOutput)
        assert torch.equal(got.sequences, expected.sequences)
    assert len(engine_calls) == 1 and len(got.scores) == 5


def test_generation_config_argument(model, paged, engine_calls):
    ids, mask = left_padded(random_prompts([7, 7, 7], seed=1))  # unpadded: a penalty on padding is HF's to serve
    eos = early_eos(free_run(model, ids, mask))
    config = GenerationConfig(max_new_tokens=10, eos_token_id=eos, pad_token_id=PAD, repetition_penalty=1.2)
    assert_same(model, paged, ids, config, attention_mask=mask)
    assert_same(model, paged, ids, generation_config=config, attention_mask=mask, max_new_tokens=4)  # kwargs win
    assert [p[0].max_new_tokens for p in engine_calls] == [10, 4]


class Collect(BaseStreamer):
    def __init__(self):
        self.puts, self.num_ends = [], 0

    def put(self, value):
        self.puts.append(value.clone())

    def end(self):
        self.num_ends += 1


def test_streamer_gets_what_hf_streams(model, paged):
    ids, mask = BATCH
    eos = free_run(model, ids[2:], mask[2:])[0, 4].item()
    streams = []
    for generate in (model.generate, paged.generate):
        streamer = Collect()
        out = generate(ids[2:], attention_mask=mask[2:], max_new_tokens=MAX_NEW, eos_token_id=eos, streamer=streamer)
        streams.append((out, streamer))
    (expected, hf_streamer), (got, our_streamer) = streams
    assert torch.equal(got, expected) and got.shape[1] == ids.shape[1] + 5
    assert len(our_streamer.puts) == len(hf_streamer.puts) == 6 and our_streamer.num_ends == hf_streamer.num_ends == 1
    assert all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(our_streamer.puts, hf_streamer.puts))


def test_beam_sampling_falls_back_with_one_warning(model, paged, caplog):
    """Beam search runs on the engine (test_hf_beam_generate.py); beam *sampling* is HF's, warned once."""
    ids, mask = BATCH
    hf_logging.warning_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="paged_hf.hf.generate"):
        for _ in range(2):
            kwargs = dict(attention_mask=mask, max_new_tokens=5, num_beams=2, do_sample=True, pad_token_id=PAD)
            torch.manual_seed(0)
            expected = model.generate(ids, **kwargs)
            torch.manual_seed(0)
            assert torch.equal(paged.generate(ids, **kwargs), expected)
    warnings = [r.getMessage() for r in caplog.records if r.name == "paged_hf.hf.generate"]
    assert len(warnings) == 1 and "beam" in warnings[0].lower(), warnings


def test_engine_limits_fall_back(model):
    """max_model_len is the engine's limit, not HF's: a longer request still gets HF's answer."""
    paged = wrap(model, max_model_len=16)
    ids, mask = BATCH
    assert_same(model, paged, ids, attention_mask=mask, max_new_tokens=MAX_NEW, pad_token_id=PAD)
    assert_no_leak(paged.generator)


def test_sampling_stays_in_the_top_k(model, paged, engine_calls):
    ids = torch.tensor(random_prompts([6, 6], seed=2))
    out = paged.generate(ids, max_new_tokens=6, do_sample=True, top_k=5, num_return_sequences=2)
    assert out.shape == (4, 12) and torch.equal(out[:, :6], ids.repeat_interleave(2, dim=0))
    with torch.no_grad():
        for t in range(6, 12):
            top5 = model(out[:, :t]).logits[:, -1].topk(5).indices  # [4, 5]
            assert (top5 == out[:, t:t + 1]).any(dim=-1).all(), t
    params = engine_calls[0][0]
    assert (params.top_k, params.temperature, params.n) == (5, 1.0, 2)


def test_hf_defaults_reach_the_engine(model, paged, engine_calls):
    """do_sample=True takes HF's default top_k=50; greedy ignores temperature/top_k/top_p as HF does."""
    ids = torch.tensor(random_prompts([4], seed=3))
    paged.generate(ids, max_new_tokens=2, do_sample=True)
    paged.generate(ids, max_new_tokens=2, temperature=0.7, top_k=3, top_p=0.5)
    sampled, greedy = engine_calls[0][0], engine_calls[1][0]
    assert (sampled.top_k, sampled.top_p, sampled.temperature) == (50, 1.0, 1.0)
    assert (greedy.temperature, greedy.top_k, greedy.top_p) == (0.0, 0, 1.0)


def char_tokenizer() -> PreTrainedTokenizerFast:
    """A 128-token, one-character-per-token tokenizer built in memory (no hub downloads)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for token in list(string.ascii_letters + string.digits + string.punctuation) + [f"w{i}" for i in range(40)]:
        vocab.setdefault(token, len(vocab))
    vocab = {token: i for token, i in vocab.items() if i < 128}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>")


def test_stop_strings(model, paged):
    tokenizer = char_tokenizer()
    ids, mask = BATCH
    generated = free_run(model, ids, mask)
    stop = tokenizer.decode(generated[0, 2:4])  # row 0 completes it at its 4th token at the latest
    kwargs = {"attention_mask": mask, "max_new_tokens": MAX_NEW, "eos_token_id": 2, "pad_token_id": PAD}
    out = assert_same(model, paged, ids, stop_strings=stop, tokenizer=tokenizer, **kwargs)
    assert out.shape[1] < ids.shape[1] + MAX_NEW or (out[0, ids.shape[1] + 4:] == PAD).all()
    with pytest.raises(ValueError, match="tokenizer"):  # HF needs tokenizer= for stop strings, so do we
        paged.generate(ids, stop_strings=stop, **kwargs)
