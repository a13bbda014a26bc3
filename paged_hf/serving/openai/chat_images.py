"""A chat request's images -> the engine's prompt: the `image_url` parts found (each with the param path a 400 names),
counted against --limit-mm-per-prompt, rendered as image placeholders by the chat template (the processor's, which
puts them where the parts are), loaded (media.py), and given with the rendered text to the engine's processor as
vLLM's prompt dict `{"prompt": text, "multi_modal_data": {"image": [...]}}` (`EngineFace.process_prompt`): the
same token ids and pixels as `paged_hf` generate on that dict. All of it in the request's worker thread.

The Responses and Anthropic routes translate their image inputs into `image_url` parts that carry their own param
path (`WHERE_KEY`), so a bad image is named as the client sent it (`input[0].content[1]`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from paged_hf.serving.openai.chat_template import render_chat
from paged_hf.serving.openai.errors import ApiError
from paged_hf.serving.openai.media import bad_image, load_image, part_url

#: an image part's param path as its client sent it (set by the routes that translate into chat requests)
WHERE_KEY = "paged_hf_param"


@dataclass(frozen=True)
class ImagePart:
    url: str
    where: str  # e.g. messages[0].content[1]


def image_parts(request) -> list[ImagePart]:
    """The request's `image_url` parts, in order (a 400 for a malformed one)."""
    found = []
    for i, message in enumerate(request.messages):
        if not isinstance(message.content, list):
            continue
        for j, part in enumerate(message.content):
            if part.get("type") == "image_url":
                where = part.get(WHERE_KEY) or f"messages[{i}].content[{j}]"
                found.append(ImagePart(part_url(part, where), where))
    return found


def check_images(parts: list[ImagePart], ctx) -> None:
    """Before anything is loaded: the model takes images, and no more than the limit."""
    if not parts:
        return
    if not ctx.engine.limits.images:
        raise bad_image(parts[0].where, "this model is served without an image processor, so it takes no images "
                        "(a vision-language model served with its processor does: docs/vision.md)")
    limit = ctx.media_limits.max_images
    if len(parts) > limit:
        raise bad_image(parts[limit].where, f"{len(parts)} images in one request; at most {limit} are accepted "
                        "(--limit-mm-per-prompt)")


def image_prompt(request, ctx, parts: list[ImagePart], tools, cancel: threading.Event | None):
    """-> the engine's processed prompt (token ids, image items) of a chat request with images."""
    if request.truncate_prompt_tokens is not None:
        raise ApiError(400, "truncate_prompt_tokens is not served with images (it could cut through an image)",
                       "invalid_request", "truncate_prompt_tokens")
    if ctx.template_policy.escape_special_tokens:
        raise ApiError(400, "images are not served by a server started with --escape-special-tokens-in-content (the "
                       "processor tokenizes the rendered chat itself)", "invalid_request", parts[0].where)
    text = render_chat(request, ctx.tokenizer, tools, ctx.settings.tool_call_parser, ctx.chat_template,
                       ctx.template_policy, cancel, parts=True)
    images = []
    for part in parts:
        if cancel is not None and cancel.is_set():
            raise ApiError(499, "client disconnected", "client_disconnected")
        images.append(load_image(part.url, part.where, ctx.media_limits))
    prompt = {"prompt": text, "multi_modal_data": {"image": images}}
    try:
        return ctx.engine.generator.process_prompt(prompt, bool(request.add_special_tokens))
    except ValueError as exc:
        raise ApiError(400, f"the images do not fit the prompt: {exc}", "invalid_image", "messages") from None
