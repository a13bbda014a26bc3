"""Block hashes of a prompt with images: a block that holds an image's placeholders hashes the image's content too
(vLLM's multimodal hashes), the blocks before it do not, and the chain carries the difference to every later block;
the KV tier's stable keys follow the same rule."""

from __future__ import annotations

from paged_hf.core.block_pool import BlockPool
from paged_hf.core.kv_cache_manager import KVCacheManager
from paged_hf.core.kv_tier import KVTier
from paged_hf.core.multimodal import MultiModalItem, block_mm_keys
from paged_hf.core.request import Request
from paged_hf.sampling_params import SamplingParams

IMAGE = 4
TOKENS = [9, 9, 9, 9, 9, IMAGE, IMAGE, IMAGE, IMAGE, IMAGE, 9, 9, 9, 9, 9, 9]  # an image at positions 5..9


def _request(content: bytes | None) -> Request:
    request = Request("r", 0, list(TOKENS), SamplingParams())
    if content is not None:
        request.mm_items = [MultiModalItem(5, 5, content, 5, data=None)]
    return request


def _hashes(request: Request) -> list[bytes]:
    return KVCacheManager(BlockPool(8), block_size=4).request_block_hashes(request)


def test_only_blocks_from_the_image_on_differ():
    text, one, other = _hashes(_request(None)), _hashes(_request(b"one")), _hashes(_request(b"other"))
    assert text[0] == one[0] == other[0]  # positions 0..3: no placeholder
    for i in (1, 2, 3):  # positions 4..7 and 8..11 hold the image; 12..15 chain on them
        assert len({text[i], one[i], other[i]}) == 3
    assert _hashes(_request(b"one")) == one  # the same image, the same hashes


def test_block_keys_name_the_overlapping_items():
    item = MultiModalItem(5, 5, b"h", 5, data=None)
    assert block_mm_keys([item], 0, 4) == b"" and block_mm_keys([item], 10, 14) == b""
    assert block_mm_keys([item], 4, 8) == block_mm_keys([item], 8, 12) != b""


def test_tier_keys_hash_the_image_too():
    tier = KVTier(b"namespace", store=None, request_key=lambda request: b"", block_size=4)
    one, other = tier.block_keys(_request(b"one")), tier.block_keys(_request(b"other"))
    assert one[0] == other[0] and one[1] != other[1]
