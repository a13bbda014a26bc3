"""The encoder-output cache (`encoder_cache_bytes`): the same image after other text (a prefix miss) runs no vision
tower and gives HF's tokens; a limit below one image's features keeps nothing and stays correct; the least recently
used image is dropped first."""

from __future__ import annotations

import pytest
import torch
from tiny_vlm import EncoderCalls, hf_generate, random_image, tiny_llava

import paged_hf
from paged_hf import SamplingParams
from paged_hf.multimodal.encoder_cache import EncoderCache

MAX_NEW = 4
PARAMS = SamplingParams(max_new_tokens=MAX_NEW, temperature=0, ignore_eos=True)
FIRST = "USER: <image> what is this ASSISTANT:"
SECOND = "USER: tell me of the water and the image <image> ASSISTANT:"  # another place: no prefix hit on it


@pytest.fixture(scope="module")
def llava():
    return tiny_llava()


def _run(llava, gen, text: str, image) -> tuple[list[int], int]:
    """-> (tokens, vision tower calls) of one prompt."""
    calls = EncoderCalls(llava[0])
    try:
        out = gen.generate([{"prompt": text, "multi_modal_data": {"image": image}}], PARAMS, use_tqdm=False)[0]
    finally:
        calls.handle.remove()
    return out.outputs[0].token_ids, calls.count


def test_the_same_image_after_other_text_runs_no_vision_tower(llava):
    gen = paged_hf.wrap(*llava, block_size=4, num_blocks=64).generator
    image = random_image(1)
    assert _run(llava, gen, FIRST, image)[1] == 1
    hits = gen.stats()["prefix_cache_hits"]
    tokens, calls = _run(llava, gen, SECOND, random_image(1))  # equal pixels, another PIL object
    assert calls == 0 and gen.stats()["encoder_cache_hits"] == 1
    assert gen.stats()["prefix_cache_hits"] == hits  # the prefix cache did not serve it
    assert tokens == hf_generate(*llava, SECOND, [image], MAX_NEW)[0]
    assert _run(llava, gen, FIRST, random_image(2))[1] == 1  # another image is encoded


def test_a_limit_below_one_image_keeps_nothing_and_stays_correct(llava):
    features_bytes = 16 * 64 * 8  # 16 rows of the text model's 64 float64 values
    gen = paged_hf.wrap(*llava, block_size=4, num_blocks=64, encoder_cache_bytes=features_bytes - 1).generator
    image = random_image(3)
    assert _run(llava, gen, FIRST, image)[1] == 1
    tokens, calls = _run(llava, gen, SECOND, image)
    assert calls == 1 and gen.stats()["encoder_cache_entries"] == 0
    assert tokens == hf_generate(*llava, SECOND, [image], MAX_NEW)[0]
    with pytest.raises(ValueError, match="encoder_cache_bytes"):
        paged_hf.wrap(*llava, block_size=4, num_blocks=64, encoder_cache_bytes=-1)


def test_eviction_drops_the_least_recently_used():
    rows = torch.zeros(4, 8)  # 128 bytes
    cache = EncoderCache(3 * 128)
    for key in (b"a", b"b", b"c"):
        cache.put(key, rows)
    assert cache.get(b"a") is rows  # "a" is now the most recently used
    cache.put(b"d", rows)
    assert list(cache.entries) == [b"c", b"a", b"d"] and cache.num_bytes == 3 * 128
    cache.put(b"e", torch.zeros(8, 8))  # twice the size: the two least recently used go
    assert list(cache.entries) == [b"d", b"e"] and cache.get(b"b") is None
    cache.put(b"huge", torch.zeros(16, 8))  # bigger than the limit: kept nowhere, nothing dropped
    assert list(cache.entries) == [b"d", b"e"]
    off = EncoderCache(0)
    off.put(b"a", rows)
    assert not off.entries
