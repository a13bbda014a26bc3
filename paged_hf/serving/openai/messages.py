"""`/v1/messages` (Anthropic's Messages API) on the chat-completions path, with Anthropic's errors.

A request becomes a chat request (chat_runner.py): `system` the system message, text blocks the content,
`tool_use` blocks an assistant's tool calls, `tool_result` blocks tool messages, an assistant's `thinking`
blocks its reasoning_content, `stop_sequences` stop, `tool_choice` any/tool the chat route's required/named
(enforced by the grammar), `thinking` include_reasoning and `budget_tokens` thinking_token_budget. The answer's
thinking, text and tool calls become content blocks; streamed, they arrive as Anthropic's events
(message_start ... message_stop).
Every error on this route, the request's validation included, is `{"type": "error", "error": {"type",
"message"}}` with Anthropic's error types.
"""

from __future__ import annotations

import json
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from paged_hf.serving.openai.chat_runner import (
    Block,
    BlockStream,
    chat_request,
    final_blocks,
    sse_event,
    sse_response,
    start,
    tool_arguments,
)
from paged_hf.serving.openai.chat_images import WHERE_KEY
from paged_hf.serving.openai.engine_loop import EngineError
from paged_hf.serving.openai.errors import ApiError
from paged_hf.serving.openai.media import check_media_type
from paged_hf.serving.openai.messages_protocol import MessagesRequest
from paged_hf.serving.openai.request_body import read_body
from paged_hf.serving.openai.serving import ServerContext

#: HTTP status -> Anthropic's error type.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error", 529: "overloaded_error"}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}


def anthropic_error(status_code: int, message: str) -> JSONResponse:
    error_type = ERROR_TYPES.get(status_code, "invalid_request_error" if status_code < 500 else "api_error")
    return JSONResponse({"type": "error", "error": {"type": error_type, "message": message}},
                        status_code=status_code)


def add_messages_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/v1/messages")
    async def create_message(http_request: Request):
        try:
            body, request = await read_body(http_request, MessagesRequest, ctx.settings,
                                            ("messages", "system", "tools"), then=translate)
            return await _create(ctx, body, request, http_request)
        except ApiError as exc:
            ctx.metrics.count_error(exc.status_code)
            where = f" ({exc.param})" if exc.param and exc.param not in exc.message else ""
            return anthropic_error(exc.status_code, exc.message + where)


def translate(body: MessagesRequest):
    """-> (the request, the chat request it becomes); in the worker thread that parsed it."""
    return body, chat_request(chat_fields(body))


async def _create(ctx: ServerContext, body: MessagesRequest, request, http_request: Request):
    if request.include_reasoning and ctx.settings.reasoning_parser is None:
        raise ApiError(400, f"thinking {body.thinking.type!r} needs a server started with --reasoning-parser (it "
                       "tells the model's thinking from its answer)", "invalid_request", "thinking")
    prepared, source = await start(ctx, request, http_request)
    message_id = f"msg_{uuid.uuid4().hex}"
    if body.stream:
        return sse_response(ctx, prepared, _events(ctx, prepared, source, message_id))
    blocks, result = await final_blocks(ctx, prepared, source)
    return JSONResponse({**message_head(message_id, prepared.model),
                         "content": [content_block(b) for b in blocks], **stop_fields(result),
                         "usage": {"input_tokens": result.prompt_tokens, "output_tokens": result.completion_tokens}})


def chat_fields(body: MessagesRequest) -> dict:
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                               "parameters": t.input_schema}} for t in body.tools or []]
    choice = body.tool_choice
    tool_choice = None
    if choice is not None:
        if choice.type == "tool" and not choice.name:
            raise ApiError(400, "tool_choice of type tool needs a name", "invalid_request", "tool_choice")
        if choice.type in ("any", "tool") and not tools:
            raise ApiError(400, f"tool_choice {choice.type!r} needs tools", "invalid_request", "tool_choice")
        tool_choice = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or \
            {"type": "function", "function": {"name": choice.name}}
    thinking = body.thinking if body.thinking is not None and body.thinking.type != "disabled" else None
    return {"model": body.model, "messages": chat_messages(body), "max_tokens": body.max_tokens,
            "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k or None,
            "stop": body.stop_sequences, "tools": tools or None, "tool_choice": tool_choice if tools else None,
            "stream": body.stream, "user": (body.metadata or {}).get("user_id"),
            "include_reasoning": thinking is not None,
            "thinking_token_budget": thinking.budget_tokens if thinking is not None else None}


def chat_messages(body: MessagesRequest) -> list[dict]:
    """The conversation as chat messages: one per Anthropic message, except that tool results become tool
    messages (before the user's text of the same turn)."""
    messages = []
    if body.system:
        messages.append({"role": "system", "content": _texts(body.system, "system")})
    for i, message in enumerate(body.messages):
        blocks = [{"type": "text", "text": message.content}] if isinstance(message.content, str) else message.content
        text, calls, thinking = [], [], []
        for j, block in enumerate(blocks):
            where, kind = f"messages[{i}].content[{j}]", block.get("type")
            if kind == "text" and isinstance(block.get("text"), str):
                text.append({"type": "text", "text": block["text"]})
            elif kind == "image" and message.role == "user":
                text.append(image_block(block, where))
            elif kind == "thinking" and message.role == "assistant":
                thinking.append(_string(block, "thinking", where))
            elif kind == "tool_use" and message.role == "assistant":
                calls.append({"id": _string(block, "id", where), "type": "function", "function": {
                    "name": _string(block, "name", where), "arguments": json.dumps(block.get("input") or {})}})
            elif kind == "tool_result" and message.role == "user":
                content = block.get("content")
                messages.append({"role": "tool", "tool_call_id": _string(block, "tool_use_id", where),
                                 "content": _texts(content if content is not None else "", where)})
            else:
                raise ApiError(400, f"{where}: content blocks of type {kind!r} are not supported in a "
                               f"{message.role} message (text, a user's image, tool_use, tool_result and an "
                               "assistant's thinking are)", "invalid_request")
        if text or calls or thinking or not blocks:
            extra = {"tool_calls": calls} if calls else {}
            extra |= {"reasoning_content": "".join(thinking)} if thinking else {}
            messages.append({"role": message.role, "content": chat_content(text), **extra})
    return messages


def chat_content(parts: list[dict]) -> str | list[dict]:
    """Text blocks joined into one string; with an image among them, the chat parts in order."""
    if all(part["type"] == "text" for part in parts):
        return "".join(part["text"] for part in parts)
    return parts


def image_block(block: dict, where: str) -> dict:
    """An `image` block (`source`: base64 with its media_type, or a url) -> a chat `image_url` part named `where`."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        media_type, data = source.get("media_type"), source.get("data")
        if not isinstance(media_type, str) or not isinstance(data, str):
            raise ApiError(400, f"{where}.source: a base64 image needs media_type and data strings", "invalid_image")
        check_media_type(media_type.lower(), f"{where}.source.media_type")
        url = f"data:{media_type.lower()};base64,{data}"
    elif kind == "url" and isinstance(source.get("url"), str):
        url = source["url"]
    else:
        raise ApiError(400, f"{where}.source: an image's source is of type base64 (media_type, data) or url",
                       "invalid_image")
    return {"type": "image_url", "image_url": {"url": url}, WHERE_KEY: where}


def _string(block: dict, name: str, where: str) -> str:
    if not isinstance(block.get(name), str):
        raise ApiError(400, f"{where}.{name} must be a string", "invalid_request")
    return block[name]


def _texts(content, where: str) -> str:
    """A string, or text blocks joined; any other block is a 400."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or any(not isinstance(b, dict) or b.get("type") != "text"
                                            or not isinstance(b.get("text"), str) for b in content):
        raise ApiError(400, f"{where}: only text blocks are supported here", "invalid_request")
    return "".join(b["text"] for b in content)


def message_head(message_id: str, model: str) -> dict:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model}


def stop_fields(result) -> dict:
    reason = STOP_REASONS.get(result.reason, "end_turn")
    if result.stop_string is not None and result.reason == "stop":
        reason = "stop_sequence"
    return {"stop_reason": reason, "stop_sequence": result.stop_string}


def tool_use_id(block: Block) -> str:
    return "toolu_" + block.call_id.removeprefix("call_")


def content_block(block: Block) -> dict:
    if block.kind == "reasoning":
        return {"type": "thinking", "thinking": block.text, "signature": ""}  # (no signature: not Claude's)
    if block.kind == "text":
        return {"type": "text", "text": block.text}
    return {"type": "tool_use", "id": tool_use_id(block), "name": block.name, "input": tool_arguments(block)}


async def _events(ctx: ServerContext, prepared, source, message_id: str):
    """Anthropic's stream: message_start, each block's start/deltas/stop, message_delta, message_stop."""
    input_tokens = len(prepared.prompt_token_ids)
    start_message = {**message_head(message_id, prepared.model), "content": [], "stop_reason": None,
                     "stop_sequence": None, "usage": {"input_tokens": input_tokens, "output_tokens": 0}}
    yield sse_event("message_start", {"type": "message_start", "message": start_message})
    yield sse_event("ping", {"type": "ping"})
    stream = BlockStream(ctx, prepared)
    try:
        async for output in source:
            for kind, block, text in stream.feed(output):
                yield _block_event(kind, block, text)
    except EngineError as exc:
        yield sse_event("error", {"type": "error", "error": {"type": "api_error", "message": str(exc)}})
        return
    if stream.result is None:
        return
    usage = {"output_tokens": stream.result.completion_tokens}
    yield sse_event("message_delta", {"type": "message_delta", "delta": stop_fields(stream.result), "usage": usage})
    yield sse_event("message_stop", {"type": "message_stop"})


def _block_event(kind: str, block: Block, text: str) -> str:
    if kind == "open":
        if block.kind == "reasoning":
            start_block = {"type": "thinking", "thinking": "", "signature": ""}
        elif block.kind == "text":
            start_block = {"type": "text", "text": ""}
        else:
            start_block = {"type": "tool_use", "id": tool_use_id(block), "name": block.name, "input": {}}
        return sse_event("content_block_start", {"type": "content_block_start", "index": block.index,
                                                 "content_block": start_block})
    if kind == "delta":
        delta = {"reasoning": {"type": "thinking_delta", "thinking": text},
                 "text": {"type": "text_delta", "text": text},
                 "tool": {"type": "input_json_delta", "partial_json": text}}[block.kind]
        return sse_event("content_block_delta", {"type": "content_block_delta", "index": block.index, "delta": delta})
    return sse_event("content_block_stop", {"type": "content_block_stop", "index": block.index})
