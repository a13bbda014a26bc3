"""Images through a real server and the official SDKs (tiny float64 LLaVA served with its processor): chat
`image_url` parts (data: URLs of PNG and JPEG, a URL on an allowed local HTTP server, a file under the allowed
folder), Responses `input_image` and Anthropic `image` blocks give the tokens of `paged_hf` generate on the same
prompt dict, itself HF's `generate` on the same processor outputs; a text-only server refuses images."""

from __future__ import annotations

import base64
import io
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from tiny_vlm import hf_generate, random_image, tiny_llava
from tiny_server import serving

import paged_hf
from paged_hf import SamplingParams
from paged_hf.serving.openai import ServerSettings, create_app
from paged_hf.serving.openai.media import MediaLimits

openai = pytest.importorskip("openai")
MODEL = "tiny-llava"
MAX_NEW = 6
TEMPLATE = ("{% for m in messages %}{{ m['role'] | upper }}: {% for p in m['content'] %}{% if p['type'] == 'image' %}"
            "<image> {% else %}{{ p['text'] }} {% endif %}{% endfor %}{% endfor %}"
            "{% if add_generation_prompt %}ASSISTANT:{% endif %}")


def encoded(image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


class ImageServer:
    """A local HTTP server of PNG bytes by path (the only remote images the tests fetch)."""

    def __init__(self, files: dict[str, bytes]):
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                body = files.get(self.path)
                self.send_response(200 if body is not None else 404)
                self.send_header("Content-Length", str(len(body or b"")))
                self.end_headers()
                self.wfile.write(body or b"")

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def images():
    png = random_image(1)
    jpeg = encoded(random_image(2), "JPEG")
    from PIL import Image

    return {"png": png, "png_bytes": encoded(png), "jpeg_bytes": jpeg,
            "jpeg": Image.open(io.BytesIO(jpeg)).convert("RGB")}


@pytest.fixture(scope="module")
def expected(images):
    """The prompts the tests send, rendered by hand, -> paged_hf's tokens on the prompt dict (checked against HF's)."""
    model, processor = tiny_llava()
    processor.chat_template = TEMPLATE
    gen = paged_hf.wrap(model, processor, block_size=4, num_blocks=64).generator
    prompts = {"one": ("USER: what is this <image> ASSISTANT:", [images["png"]]),
               "two": ("USER: <image> and <image> which is more ASSISTANT:", [images["png"], images["jpeg"]]),
               "system": ("SYSTEM: you are here USER: <image> what is this ASSISTANT:", [images["png"]])}
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    outputs = gen.generate([{"prompt": text, "multi_modal_data": {"image": imgs}} for text, imgs in prompts.values()],
                           params, use_tqdm=False)
    tokens = {name: out.outputs[0].token_ids for name, out in zip(prompts, outputs)}
    for name, (text, imgs) in prompts.items():
        assert tokens[name] == hf_generate(model, processor, text, imgs, MAX_NEW)[0], name
    texts = {name: processor.tokenizer.decode(ids, skip_special_tokens=True) for name, ids in tokens.items()}
    return gen, processor, texts


@pytest.fixture(scope="module")
def server(expected, images, tmp_path_factory):
    gen, processor, texts = expected
    folder = tmp_path_factory.mktemp("media")
    (folder / "one.png").write_bytes(images["png_bytes"])
    remote = ImageServer({"/one.png": images["png_bytes"]})
    limits = MediaLimits(allowed_domains=("127.0.0.1",), allowed_local_path=str(folder), max_images=2,
                         max_bytes=64 << 10, max_pixels=256 * 256, fetch_timeout_s=2.0)
    app = create_app(gen, processor, MODEL, ServerSettings(media_limits=limits))
    with serving(app) as url:
        yield url, texts, remote, folder
    remote.close()


def chat(url: str, content, **extra):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                          max_tokens=MAX_NEW, temperature=0, extra_body={"ignore_eos": True}, **extra)


def image_url(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_chat_image_url_data_urls_give_the_prompt_dicts_tokens(server, images):
    url, texts, _, _ = server
    answer = chat(url, [{"type": "text", "text": "what is this"}, image_url(data_url(images["png_bytes"]))])
    assert answer.choices[0].message.content == texts["one"]
    two = chat(url, [image_url(data_url(images["png_bytes"])), {"type": "text", "text": "and"},
                     image_url(data_url(images["jpeg_bytes"], "image/jpeg")),
                     {"type": "text", "text": "which is more"}])
    assert two.choices[0].message.content == texts["two"]  # in order: PNG first, then JPEG
    assert two.usage.prompt_tokens > 32  # the processor's expansion (16 tokens per image)


def test_an_allowed_remote_url_and_an_allowed_local_file(server):
    url, texts, remote, folder = server
    parts = [{"type": "text", "text": "what is this"}]
    assert chat(url, parts + [image_url(f"{remote.url}/one.png")]).choices[0].message.content == texts["one"]
    local = chat(url, parts + [image_url(f"file://{folder}/one.png")])
    assert local.choices[0].message.content == texts["one"]


def test_responses_input_image(server, images):
    url, texts, _, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    response = client.responses.create(model=MODEL, max_output_tokens=MAX_NEW, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "what is this"},
                                     {"type": "input_image", "image_url": data_url(images["png_bytes"])}]}])
    assert response.output_text == texts["one"]


def test_anthropic_image_block(server, images):
    anthropic = pytest.importorskip("anthropic")
    url, texts, _, _ = server
    client = anthropic.Anthropic(base_url=url, api_key="none")
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(images["png_bytes"]).decode()}
    content = [{"type": "image", "source": source}, {"type": "text", "text": "what is this"}]
    message = client.messages.create(model=MODEL, max_tokens=MAX_NEW, system="you are here", extra_body={
        "temperature": 0}, messages=[{"role": "user", "content": content}])
    assert message.content[0].text == texts["system"]


def test_a_text_only_server_refuses_images_naming_why(images):
    from tiny_server import tiny_tokenizer  # noqa: PLC0415

    from conftest import tiny_model  # noqa: PLC0415

    gen = paged_hf.wrap(tiny_model(), tiny_tokenizer(), block_size=4, num_blocks=32).generator
    with serving(create_app(gen, tiny_tokenizer(), MODEL)) as url:
        with pytest.raises(openai.BadRequestError) as refused:
            chat(url, [{"type": "text", "text": "what"}, image_url(data_url(images["png_bytes"]))])
    error = refused.value.body
    assert error["param"] == "messages[0].content[1]" and "without an image processor" in error["message"]
