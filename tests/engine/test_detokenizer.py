"""The incremental detokenizer: the same text as one decode of the whole output, token by token, on the real
default tokenizer (byte-level BPE: multi-byte characters split over tokens), and stop strings found only in
the new text."""

from __future__ import annotations

import random

import pytest
from conftest import tiny_model

import paged_hf
from paged_hf import SamplingParams
from paged_hf.engine.detokenizer import IncrementalDetokenizer

TEXTS = ["Hello, world! The café's crème brûlée costs 5€.", "日本語のテキストと中文字符 mixed with English.",
         "Emoji: 👍🏽 🇫🇷 👨‍👩‍👧 🤖✨ and math ∑∫√ ≠ ≤.", "  leading spaces,\ttabs\nand\n\nnewlines  ",
         "Ünïcödé ñ ß Ω Ж ק ع ह 한국어 ελληνικά"]


@pytest.fixture(scope="module")
def tokenizer(loaded):
    return loaded[1]


def incremental(tokenizer, token_ids, chunks=1, **kwargs):
    """Feed `token_ids` `chunks` at a time; the text seen while running only ever grows."""
    detok, seen = IncrementalDetokenizer(tokenizer, **kwargs), ""
    for i in range(0, len(token_ids), chunks):
        detok.update(token_ids[i:i + chunks])
        visible = detok.visible_text(finished=False)
        assert visible.startswith(seen)
        seen = visible
    return detok.visible_text(finished=True)


@pytest.mark.slow
def test_incremental_text_equals_one_decode_on_the_real_tokenizer(tokenizer):
    """Through the Rust tokenizer's own decode (HF's decode is exactly it here), against HF's decode."""
    assert IncrementalDetokenizer(tokenizer).backend is tokenizer.backend_tokenizer
    rng = random.Random(0)
    specials = list(tokenizer.all_special_ids)
    cases = [tokenizer.encode(text, add_special_tokens=False) for text in TEXTS]
    byte_tokens = [i for i in range(len(tokenizer)) if "\ufffd" in tokenizer.decode([i])]  # pieces of characters
    assert len(byte_tokens) > 50
    for _ in range(60):  # random token ids, with many halves of multi-byte characters and special tokens mixed in
        pool = rng.choice([range(len(tokenizer)), byte_tokens, byte_tokens + specials + list(range(200))])
        cases.append([rng.choice(pool) for _ in range(rng.randint(1, 40))])
    for case in cases:
        for chunks in (1, 3):
            assert incremental(tokenizer, case, chunks) == tokenizer.decode(case, skip_special_tokens=True), case


@pytest.mark.slow
def test_stop_strings_on_the_real_tokenizer_are_cut_where_they_first_appear(tokenizer):
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        full = tokenizer.decode(ids)
        for stop in {full[5:7], full[-3:], " ", "€", "👍"}:
            if stop and stop in full:
                assert incremental(tokenizer, ids, stop=[stop]) == full[:full.index(stop)], (text, stop)


class CharTokenizer:
    """Token i is character i of ALPHABET; decode joins them (enough to test the stop-string rules)."""

    ALPHABET = "abcdefgh\n. xyz"

    def decode(self, token_ids, skip_special_tokens=True):
        return "".join(self.ALPHABET[i] for i in token_ids)

    def ids(self, text):
        return [self.ALPHABET.index(c) for c in text]


@pytest.mark.parametrize("text,stop,min_new_tokens,expected", [
    ("ab\ncdefgh", ["\n"], 5, "ab\ncdefgh"),  # a stop string inside the first min_new_tokens tokens is not one
    ("ab\ncd\nefg", ["\n"], 5, "ab\ncd"),  # the first one after min_new_tokens is
    ("ab\ncd", ["\n"], 0, "ab"),
    ("abcxyzabc", ["zab", "yz"], 0, "abcx"),  # the earliest of several
    ("abcdxyz", ["dxy"], 4, "abc"),  # ends in token 6 > 4 though it starts in token 4: found
])
def test_stop_strings_respect_min_new_tokens(text, stop, min_new_tokens, expected):
    tok = CharTokenizer()
    detok = IncrementalDetokenizer(tok, stop=stop, min_new_tokens=min_new_tokens)
    for token_id in tok.ids(text):
        if detok.update([token_id]):
            break
    assert detok.visible_text(finished=True) == expected


def test_min_new_tokens_with_a_stop_string_in_the_generator():
    """The issue's case: with min_new_tokens=5 and stop=["\\n"], a "\\n" at token 2 neither stops the request
    nor cuts its text (before: stopped at token 5 with the text cut before token 2)."""
    tok = CharTokenizer()
    tok.ALPHABET = "a" * 128
    engine = paged_hf.wrap(tiny_model("llama"), tok, num_blocks=32).generator
    prompt = [1, 2, 3, 4]
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    free = engine.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    # a tokenizer whose text has "\n" exactly at the request's token 2 (index 1), and nowhere else
    tok.ALPHABET = "".join("\n" if i == free[1] else "a" for i in range(128))
    assert free.count(free[1]) == 1, free
    late = engine.generate([prompt], SamplingParams(**vars(params) | dict(min_new_tokens=5, stop=["\n"])),
                           use_tqdm=False)[0].outputs[0]
    assert late.token_ids == free and late.finish_reason == "length"
    assert late.text == tok.decode(free)
    early = engine.generate([prompt], SamplingParams(**vars(params) | dict(stop=["\n"])), use_tqdm=False)[0].outputs[0]
    assert early.token_ids == free[:2] and early.finish_reason == "stop" and early.text == "a"


def test_generator_text_is_decoded_once_per_token(monkeypatch):
    """Linear, not quadratic: each token is decoded in a window of a few tokens, never the whole output."""
    tok = CharTokenizer()
    tok.ALPHABET = "".join(chr(ord("a") + i % 26) for i in range(128))
    lengths = []
    original = tok.decode
    monkeypatch.setattr(tok, "decode", lambda ids, **kw: lengths.append(len(ids)) or original(ids, **kw))
    engine = paged_hf.wrap(tiny_model("llama"), tok, num_blocks=64).generator
    rid = engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=200, temperature=0, ignore_eos=True))
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            final = output
    assert final.request_id == rid and len(final.outputs[0].token_ids) == 200
    assert max(lengths) <= 4 and sum(lengths) < 200 * 6


@pytest.mark.slow
def test_real_model_tokens_decode_to_the_whole_decode(loaded):
    """Sampled text from the real model (temperature 1, so odd bytes appear) equals one decode of its tokens."""
    model, tokenizer = loaded
    engine = paged_hf.wrap(model, tokenizer, num_blocks=64).generator
    prompt = tokenizer.encode("Write some emoji and Japanese: 👍 日本", add_special_tokens=False)
    outputs = engine.generate([prompt] * 4, SamplingParams(max_new_tokens=24, temperature=1.5, seed=3, n=2),
                              use_tqdm=False)
    for output in outputs:
        for c in output.outputs:
            assert c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True)


def test_kept_special_tokens_stay_in_the_text_and_the_others_go():
    """A reasoning parser's markers that are special tokens (Magistral's [THINK], gpt-oss's channels) stay in the
    text; every other special token goes as skip_special_tokens drops it, token by token as in one decode."""
    from conftest import real_tokenizer  # noqa: PLC0415

    tokenizer = real_tokenizer()
    kept = tokenizer.all_special_tokens[0]
    specials = list(tokenizer.all_special_ids)
    rng = random.Random(1)
    for _ in range(30):
        case = [rng.choice(specials) if rng.random() < 0.3 else rng.randrange(200, 5000) for _ in range(30)]
        whole = tokenizer.decode(case, skip_special_tokens=False)
        for special in tokenizer.all_special_tokens:
            whole = whole.replace(special, "") if special != kept else whole
        for chunks in (1, 4):
            assert incremental(tokenizer, case, chunks, kept_special_tokens=(kept,)) == whole
    with_kept = tokenizer.convert_tokens_to_ids(kept)
    assert kept in incremental(tokenizer, [300, with_kept, 400], kept_special_tokens=(kept,))
    assert kept not in incremental(tokenizer, [300, with_kept, 400])
