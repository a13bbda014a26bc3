"""The server's side of a request's images: `multimodal/media.py` loads them under `MediaLimits` (the serve flags),
and each refusal it names becomes a 400 (`invalid_image`, its param the content part)."""

from __future__ import annotations

import contextlib

from paged_hf.multimodal import media
from paged_hf.multimodal.media import FORMATS, MEDIA_TYPES, MediaLimits
from paged_hf.serving.openai.errors import ApiError

__all__ = ["FORMATS", "MEDIA_TYPES", "MediaLimits", "bad_image", "check_media_type", "load_image", "part_url"]


def bad_image(where: str, message: str) -> ApiError:
    return ApiError(400, f"{where}: {message}", "invalid_image", where)


def load_image(url: str, where: str, limits: MediaLimits):
    """media.load_image, its refusals as 400s."""
    with _as_400():
        return media.load_image(url, where, limits)


def check_media_type(media_type: str, where: str) -> None:
    with _as_400():
        media.check_media_type(media_type, where)


def part_url(part: dict, where: str) -> str:
    """media.part_url, its refusals as 400s."""
    with _as_400():
        return media.part_url(part, where)


@contextlib.contextmanager
def _as_400():
    try:
        yield
    except media.MediaError as error:
        raise ApiError(400, str(error), "invalid_image", error.where) from None
