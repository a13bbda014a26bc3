"""Hostile and malformed images get a 400 naming the content part and what is wrong, through a real server: bad
base64, a truncated PNG, a payload that is no image, an unsupported media type, a decompression bomb (refused from
its header), too many bytes or images, a domain not allowed, a file outside the allowed folder, a slow remote
server (the fetch timeout); a served request still answers after them, and a running stream never stalls past
250 ms while they are refused."""

from __future__ import annotations

import base64
import concurrent.futures
import struct
import threading
import time
import zlib

import httpx
import pytest
from test_serve_images import MAX_NEW, MODEL, ImageServer, data_url, encoded, image_url
from tiny_server import serving
from tiny_vlm import random_image, tiny_llava

import paged_hf
from paged_hf.serving.openai import ServerSettings, create_app
from paged_hf.serving.openai.media import MediaLimits

TEMPLATE = ("{% for m in messages %}{{ m['role'] | upper }}: {% for p in m['content'] %}{% if p['type'] == 'image' %}"
            "<image> {% else %}{{ p['text'] }} {% endif %}{% endfor %}{% endfor %}ASSISTANT:")


def png_header(width: int, height: int) -> bytes:
    """A valid PNG whose header declares width x height (its one IDAT row is all it holds): a bomb's shape."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


class SlowHandlerServer(ImageServer):
    """Answers after `delay_s` (a remote that stalls)."""

    def __init__(self, delay_s: float):
        super().__init__({})
        handler = self.httpd.RequestHandlerClass
        original = handler.do_GET

        def slow(self):
            time.sleep(delay_s)
            original(self)
        handler.do_GET = slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model, processor = tiny_llava()
    processor.chat_template = TEMPLATE
    gen = paged_hf.wrap(model, processor, block_size=4, num_blocks=64).generator
    folder = tmp_path_factory.mktemp("allowed")
    (folder / "ok.png").write_bytes(encoded(random_image(1)))
    outside = tmp_path_factory.mktemp("outside") / "secret.png"
    outside.write_bytes(encoded(random_image(1)))
    slow = SlowHandlerServer(3.0)
    limits = MediaLimits(allowed_domains=("127.0.0.1",), allowed_local_path=str(folder), max_images=2,
                         max_bytes=32 << 10, max_pixels=128 * 128, fetch_timeout_s=1.0)
    with serving(create_app(gen, processor, MODEL, ServerSettings(media_limits=limits))) as url:
        yield url, folder, outside, slow
    slow.close()


def post(url: str, parts: list) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": MAX_NEW, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what"}, *parts]}]}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


PNG = encoded(random_image(1))
HOSTILE = {
    "bad base64": ("data:image/png;base64,not*base64!", "not valid base64"),
    "truncated png": (data_url(PNG[: len(PNG) // 2]), "truncated or corrupt"),
    "no image": (data_url(b"hello, I am text " * 10), "not an image"),
    "svg": ("data:image/svg+xml;base64," + b64(b"<svg/>"), "media type 'image/svg+xml'"),
    "not base64": ("data:image/png,rawbytes", "must be base64"),
    "bomb": (data_url(png_header(100_000, 100_000)), "pixels"),
    "over the pixel limit": (data_url(png_header(1000, 1000)), "1000 x 1000 pixels"),
    "too many bytes": (data_url(b"\0" * (40 << 10)), "--max-image-bytes"),
    "domain not allowed": ("http://example.com/a.png", "--allowed-media-domains"),
    "scheme": ("ftp://127.0.0.1/a.png", "scheme 'ftp'"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_image_is_a_400_naming_its_part(server, name):
    url, *_ = server
    image, named = HOSTILE[name]
    reply = post(url, [image_url(image)])
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "messages[0].content[1]" and named in error["message"], error


def test_files_outside_the_allowed_folder_and_too_many_images(server):
    url, folder, outside, _ = server
    for path in (outside, folder / ".." / outside.parent.name / outside.name, folder / "missing.png"):
        reply = post(url, [image_url(f"file://{path}")])
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages[0].content[1]", reply.text
    assert "not under --allowed-local-media-path" in post(url, [image_url(f"file://{outside}")]).text
    three = post(url, [image_url(f"file://{folder}/ok.png")] * 3)
    assert three.status_code == 400 and three.json()["error"]["param"] == "messages[0].content[3]"
    assert "--limit-mm-per-prompt" in three.text
    assert post(url, [image_url(f"file://{folder}/ok.png")] * 2).status_code == 200


def test_a_stalled_remote_is_a_400_within_the_fetch_timeout(server):
    url, _, _, slow = server
    start = time.monotonic()
    reply = post(url, [image_url(f"{slow.url}/a.png")])
    assert reply.status_code == 400 and "--media-fetch-timeout" in reply.text, reply.text
    assert time.monotonic() - start < 2.5


def test_anthropic_and_responses_name_their_own_paths(server):
    url, *_ = server
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(PNG[:100])}}
    reply = httpx.post(f"{url}/v1/messages", json={"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "what"}, block]}]})
    assert reply.status_code == 400 and "messages[0].content[1]" in reply.json()["error"]["message"], reply.text
    reply = httpx.post(f"{url}/v1/responses", json={"model": MODEL, "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "data:text/plain;base64,aGk="}]}]})
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == "input[0].content[0]", error


def test_the_serve_flags_set_the_image_limits(tmp_path):
    from paged_hf.entrypoints import cli  # noqa: PLC0415
    from paged_hf.serving.assembly import serve_settings  # noqa: PLC0415

    args = cli.build_parser().parse_args([
        "serve", "--generation-config", "vllm", "--allowed-media-domains", "images.example.com", "127.0.0.1",
        "--allowed-local-media-path", str(tmp_path), "--limit-mm-per-prompt", '{"image": 3}', "--max-image-bytes",
        "1000", "--max-image-pixels", "4096", "--media-fetch-timeout", "2.5"])
    assert serve_settings(args, None).media_limits == MediaLimits(("images.example.com", "127.0.0.1"), str(tmp_path),
                                                                  3, 1000, 4096, 2.5)
    assert serve_settings(cli.build_parser().parse_args(["serve", "--generation-config", "vllm"]),
                          None).media_limits == MediaLimits()
    for bad in ('{"video": 1}', "3", '{"image": "x"}'):
        with pytest.raises(ValueError, match="limit-mm-per-prompt"):
            serve_settings(cli.build_parser().parse_args(["serve", "--limit-mm-per-prompt", bad]), None)


def test_a_running_stream_does_not_stall_while_hostile_images_are_refused(server):
    """Hostile images (a bomb, a stalled remote, bad bytes, too many bytes) refused while a stream runs: the gaps
    between its chunks stay under 250 ms (their decoding and fetching are off the event loop and the engine)."""
    url, _, _, slow = server
    arrivals, first_chunk = [], threading.Event()

    def stream():
        body = {"model": MODEL, "max_tokens": 200, "stream": True, "messages": [{"role": "user", "content": "what"}]}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.monotonic())
                    first_chunk.set()

    streaming = threading.Thread(target=stream)
    streaming.start()
    assert first_chunk.wait(30)
    hostile = [HOSTILE[name][0] for name in ("bomb", "truncated png", "too many bytes")] + [f"{slow.url}/a.png"]
    with concurrent.futures.ThreadPoolExecutor(len(hostile)) as pool:
        started = time.monotonic()
        replies = list(pool.map(lambda image: post(url, [image_url(image)]), hostile))
        ended = time.monotonic()
    streaming.join(60)
    assert [reply.status_code for reply in replies] == [400] * len(hostile)
    during = [t for t in arrivals if started <= t <= ended]  # the stream may end first (the stall takes 1 s)
    gaps = [b - a for a, b in zip(during, during[1:])]
    assert len(during) > 10 and max(gaps) < 0.25, (len(during), max(gaps, default=None))


def test_a_malformed_image_url_part_is_a_400_naming_it(server):
    url, *_ = server
    for part, named in (({"type": "image_url", "image_url": {"url": data_url(PNG), "detail": "ultra"}},
                         "detail must be one of"),
                        ({"type": "image_url", "image_url": {"url": data_url(PNG), "size": 3}}, "['size']"),
                        ({"type": "image_url", "image_url": 7}, "an image_url part is")):
        reply = post(url, [part])
        error = reply.json()["error"]
        assert reply.status_code == 400 and error["param"] == "messages[0].content[1]" and named in error["message"]
