"""An image a request sends (a chat `image_url` part, a Responses `input_image`, an Anthropic `image` block, an
`image_url` part given to `LLM.chat`) -> a PIL image, under `MediaLimits`; every refusal is a `MediaError` (a
ValueError; the server's 400, serving/openai/media.py) naming the content part (`messages[0].content[1]`) and the
limit or flag.

Sources: a `data:` URL (base64, an image media type); an `http(s)` URL only on a domain of --allowed-media-domains
(no other is ever fetched: a server that fetches any URL is a proxy into its own network), fetched with a timeout
for the whole download, no redirects, at most --max-image-bytes read; a `file://` URL only under
--allowed-local-media-path (its real path: no `..` or link leads out). Any other scheme is refused.

Decoding: only the formats of `FORMATS` (PIL's decoders of other formats, EPS's among them, never run); the width
and height come from the header, and an image of more than --max-image-pixels is refused before its pixels are
decoded (a decompression bomb: a few kilobytes of PNG that inflate to gigabytes); then it is decoded completely (a
truncated or corrupt file is a 400 here, not an error in the engine) and converted to RGB (as vLLM's loader).
In the server all of it runs in a worker thread (serving.prepare), never on the event loop or the engine thread.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import time
import urllib.parse
from dataclasses import dataclass

#: PIL's format names served, and the media types a data URL or an Anthropic block may declare
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
MEDIA_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif", "image/bmp")
FETCH_CHUNK_BYTES = 1 << 16
DETAILS = ("auto", "low", "high")  # OpenAI's `detail`: accepted; the processor decides the resolution


@dataclass(frozen=True)
class MediaLimits:
    """What a request's images may be (ServerSettings' media fields; `paged-hf serve` flags in parentheses)."""

    allowed_domains: tuple[str, ...] = ()  # hosts whose http(s) image URLs are fetched (--allowed-media-domains)
    allowed_local_path: str | None = None  # file:// URLs only under this folder (--allowed-local-media-path)
    max_images: int = 16  # images in one request (--limit-mm-per-prompt '{"image": N}')
    max_bytes: int = 20 << 20  # one image's encoded bytes (--max-image-bytes)
    max_pixels: int = 4096 * 4096  # one image's width x height (--max-image-pixels)
    fetch_timeout_s: float = 5.0  # one remote image's whole download (--media-fetch-timeout)


class MediaError(ValueError):
    """A refused image: the message names the content part (`where`) and what is wrong."""

    def __init__(self, where: str, message: str):
        super().__init__(f"{where}: {message}")
        self.where = where


def bad_image(where: str, message: str) -> MediaError:
    return MediaError(where, message)


def part_url(part: dict, where: str) -> str:
    """The URL of a chat `image_url` part (`{"type": "image_url", "image_url": {"url": ..., "detail": ...}}`, or the
    URL as a string); a MediaError naming `where` for a malformed one."""
    value = part.get("image_url")
    if isinstance(value, str):
        return value
    if not isinstance(value, dict) or not isinstance(value.get("url"), str):
        raise bad_image(where, 'an image_url part is {"type": "image_url", "image_url": {"url": "data:..."}}')
    unknown = sorted(set(value) - {"url", "detail"})
    if unknown:
        raise bad_image(where, f"image_url fields {unknown} are not served (url and detail are)")
    if value.get("detail", "auto") not in DETAILS:
        raise bad_image(where, f"detail must be one of {', '.join(DETAILS)}")
    return value["url"]


def load_image(url: str, where: str, limits: MediaLimits):
    """The image at `url` (data:, http(s):, file:) as an RGB PIL image; a MediaError naming `where` for anything
    wrong."""
    if not isinstance(url, str) or not url:
        raise bad_image(where, "the image URL must be a non-empty string")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        data = data_url_bytes(url, where, limits)
    elif scheme in ("http", "https"):
        data = fetch(url, where, limits)
    elif scheme == "file":
        data = local_file(url, where, limits)
    else:
        raise bad_image(where, f"image URLs of scheme {scheme!r} are not served (data: URLs are; http(s): on a "
                        "domain of --allowed-media-domains; file: under --allowed-local-media-path)")
    return decode(data, where, limits)


def data_url_bytes(url: str, where: str, limits: MediaLimits) -> bytes:
    """`data:image/png;base64,...` -> its bytes: an image media type, base64, at most max_bytes."""
    head, comma, payload = url.partition(",")
    if not comma:
        raise bad_image(where, "a data URL needs a comma before its data (data:image/png;base64,...)")
    fields = [field.strip().lower() for field in head[len("data:"):].split(";")]
    if "base64" not in fields[1:]:
        raise bad_image(where, "a data URL's image must be base64 (data:image/png;base64,...)")
    check_media_type(fields[0], where)
    return base64_bytes(payload, where, limits)


def check_media_type(media_type: str, where: str) -> None:
    if media_type not in MEDIA_TYPES:
        raise bad_image(where, f"media type {media_type!r} is not served (served: {', '.join(MEDIA_TYPES)})")


def base64_bytes(payload: str, where: str, limits: MediaLimits) -> bytes:
    """Base64 text -> bytes; refused before decoding when it would hold more than max_bytes."""
    if not isinstance(payload, str):
        raise bad_image(where, "the image data must be a base64 string")
    payload = "".join(payload.split())  # line breaks some encoders add
    if len(payload) // 4 * 3 > limits.max_bytes:
        raise too_large(where, limits)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise bad_image(where, "the image data is not valid base64") from None


def too_large(where: str, limits: MediaLimits) -> MediaError:
    return bad_image(where, f"the image is larger than {limits.max_bytes} bytes (--max-image-bytes)")


def fetch(url: str, where: str, limits: MediaLimits) -> bytes:
    """An allowed domain's image: no redirects, the whole download within fetch_timeout_s, at most max_bytes."""
    import httpx  # noqa: PLC0415 - a dependency of the 'serve' extra (FastAPI's test client's too)

    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    if host not in {domain.lower() for domain in limits.allowed_domains}:
        raise bad_image(where, f"remote images are fetched only from the domains of --allowed-media-domains; "
                        f"{host!r} is not one (send the image as a data: URL)")
    deadline = time.monotonic() + limits.fetch_timeout_s
    timed_out = bad_image(where, f"fetching the image took more than {limits.fetch_timeout_s:g} s "
                          "(--media-fetch-timeout)")
    try:
        with httpx.Client(timeout=limits.fetch_timeout_s, follow_redirects=False) as client, \
                client.stream("GET", url) as response:
            if response.status_code != 200:
                raise bad_image(where, f"fetching the image answered HTTP {response.status_code} (redirects are "
                                "not followed)")
            chunks, size = [], 0
            for chunk in response.iter_bytes(FETCH_CHUNK_BYTES):
                size += len(chunk)
                if size > limits.max_bytes:
                    raise too_large(where, limits)
                if time.monotonic() > deadline:
                    raise timed_out
                chunks.append(chunk)
    except httpx.TimeoutException:
        raise timed_out from None
    except httpx.HTTPError as exc:
        raise bad_image(where, f"fetching the image failed: {type(exc).__name__}") from None
    return b"".join(chunks)


def local_file(url: str, where: str, limits: MediaLimits) -> bytes:
    """A file:// URL's bytes, only for a file whose real path is under allowed_local_path."""
    if limits.allowed_local_path is None:
        raise bad_image(where, "file: URLs are served only with --allowed-local-media-path")
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise bad_image(where, f"a file: URL names a file of this machine (host {parts.netloc!r} is not served)")
    root = os.path.realpath(limits.allowed_local_path)
    path = os.path.realpath(urllib.parse.unquote(parts.path))
    if os.path.commonpath([root, path]) != root:
        raise bad_image(where, "the file is not under --allowed-local-media-path")
    try:
        with open(path, "rb") as fh:
            data = fh.read(limits.max_bytes + 1)
    except OSError as exc:
        raise bad_image(where, f"the file cannot be read ({exc.strerror or type(exc).__name__})") from None
    if len(data) > limits.max_bytes:
        raise too_large(where, limits)
    return data


def decode(data: bytes, where: str, limits: MediaLimits):
    """Encoded bytes -> an RGB PIL image: a served format, at most max_pixels (from the header, before the pixels
    are decoded), decoded completely."""
    from PIL import Image  # noqa: PLC0415 - transformers' image processors need it anyway

    if len(data) > limits.max_bytes:
        raise too_large(where, limits)
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError:  # PIL's own limit, far above ours: the same refusal
        raise too_many_pixels(where, limits, None) from None
    except (OSError, ValueError, SyntaxError):
        raise bad_image(where, f"the data is not an image of a served format ({', '.join(FORMATS)})") from None
    width, height = image.size
    if width * height > limits.max_pixels:
        raise too_many_pixels(where, limits, (width, height))
    if width < 1 or height < 1:
        raise bad_image(where, f"the image is {width} x {height} pixels")
    try:
        image.load()
        return image.convert("RGB")
    except Exception as exc:  # noqa: BLE001 - a decoder's refusal of a corrupt file (OSError, SyntaxError...)
        raise bad_image(where, f"the {image.format} image is truncated or corrupt ({exc})") from None


def too_many_pixels(where: str, limits: MediaLimits, size: tuple[int, int] | None) -> MediaError:
    shape = f" is {size[0]} x {size[1]} pixels" if size else ""
    return bad_image(where, f"the image{shape}: more than {limits.max_pixels} pixels (--max-image-pixels) are "
                     "refused before decoding")
