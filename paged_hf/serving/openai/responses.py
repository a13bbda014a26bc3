"""`/v1/responses` (OpenAI's Responses API) on the chat-completions path, and its response store.

A request becomes a chat request (chat_runner.py): `instructions` the system message, `input` items the
messages (`function_call` items an assistant's tool calls, `function_call_output` items tool messages,
`reasoning` items the thinking of the assistant message after them), `previous_response_id` the stored
conversation before them (its tool calls, their outputs and the thinking included), `text.format` the
response_format, `max_output_tokens` max_tokens, `reasoning.effort` reasoning_effort. The answer's thinking
(with --reasoning-parser), text and tool calls become output items; streamed, they arrive as the Responses event
types (response.created ... response.completed).
"""

from __future__ import annotations

import asyncio
import time
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
)
from paged_hf.serving.openai.chat_images import WHERE_KEY
from paged_hf.serving.openai.engine_loop import EngineError
from paged_hf.serving.openai.errors import ApiError
from paged_hf.serving.openai.request_body import read_body
from paged_hf.serving.openai.responses_protocol import ResponsesRequest
from paged_hf.serving.openai.responses_store import RESPONSE_ID, ResponseStore
from paged_hf.serving.openai.serving import ServerContext, request_key_name
from paged_hf.serving.openai.tenancy import owner_of

#: The chat request's field names that a Responses client knows by another name (a 400's `param`).
PARAMS = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format",
          "structured_outputs": "text.format", "reasoning_effort": "reasoning.effort"}


def add_responses_routes(app: FastAPI, ctx: ServerContext) -> ResponseStore:
    s = ctx.settings
    store = ResponseStore(s.responses_store_max_count, s.responses_store_max_bytes, s.responses_store_dir)
    app.state.responses_store = store

    @app.post("/v1/responses")
    async def create_response(http_request: Request):
        try:
            body = await read_body(http_request, ResponsesRequest, ctx.settings, ("input", "tools"))
            return await _create(ctx, store, body, http_request)
        except ApiError as exc:
            exc.param = PARAMS.get(exc.param, exc.param)
            raise

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, http_request: Request):
        return JSONResponse((await _stored(store, response_id, request_owner(ctx, http_request)))["response"])

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, http_request: Request):
        owner = request_owner(ctx, http_request)
        if not RESPONSE_ID.match(response_id) or not await asyncio.to_thread(store.delete, response_id, owner):
            raise ApiError(404, f"No response with id {response_id!r} is stored", "response_not_found", "response_id")
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    return store


def request_owner(ctx: ServerContext, http_request: Request) -> str | None:
    """Whose stored responses the request may see and makes (tenancy.py)."""
    return owner_of(ctx.settings, request_key_name(http_request))


async def _stored(store: ResponseStore, response_id: str, owner: str | None, param: str = "response_id") -> dict:
    """The record `owner` stored; another key's is a 404 exactly like an unknown id."""
    record = await asyncio.to_thread(store.get, response_id, owner) if RESPONSE_ID.match(response_id) else None
    if record is None:
        raise ApiError(404, f"No response with id {response_id!r} is stored (never stored, deleted, or evicted "
                       "from the bounded store)", "response_not_found", param)
    return record


async def _create(ctx: ServerContext, store: ResponseStore, body: ResponsesRequest, http_request: Request):
    owner = request_owner(ctx, http_request)
    history = []
    if body.previous_response_id is not None:
        history = (await _stored(store, body.previous_response_id, owner, "previous_response_id"))["messages"]
    conversation, request = await asyncio.to_thread(translate, body, history)  # thousands of items: off the loop
    prepared, source = await start(ctx, request, http_request)
    answer = Answer(ctx, store, body, prepared, conversation, owner)
    if body.stream:
        return sse_response(ctx, prepared, answer.events(source))
    blocks, result = await final_blocks(ctx, prepared, source)
    return JSONResponse(await answer.finish(blocks, result))


def translate(body: ResponsesRequest, history: list[dict]):
    """-> (the conversation: the stored one and this request's input, the chat request that continues it)."""
    conversation = history + input_messages(body.input)
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    return conversation, chat_request(chat_fields(body, system + conversation))


def chat_fields(body: ResponsesRequest, messages: list[dict]) -> dict:
    """The chat request for this Responses request (None values: the chat route's defaults)."""
    tools = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
             for tool in body.tools or []]
    choice = body.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = {"type": "function", "function": {"name": choice.name}}
    return {"model": body.model, "messages": messages, "max_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "min_p": body.min_p,
            "repetition_penalty": body.repetition_penalty, "seed": body.seed, "tools": tools or None,
            "tool_choice": choice, "parallel_tool_calls": body.parallel_tool_calls,
            "response_format": response_format(body), "stream": body.stream, "user": body.user,
            "reasoning_effort": body.reasoning.effort if body.reasoning is not None else None}


def response_format(body: ResponsesRequest) -> dict | None:
    spec = body.text.format if body.text is not None else None
    if spec is None or spec.type != "json_schema":
        return None if spec is None else {"type": spec.type}
    if spec.schema_ is None or not spec.name:
        raise ApiError(400, "text.format of type json_schema needs name and schema", "invalid_request", "text.format")
    schema = {"name": spec.name, "schema": spec.schema_, "description": spec.description, "strict": spec.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


def input_messages(items: str | list[dict]) -> list[dict]:
    """`input` as chat messages. A function_call item joins the assistant message before it (one assistant
    turn: its text and its calls), as the chat template expects."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    thinking = []  # reasoning items: the thinking of the assistant message that follows them
    for i, item in enumerate(items):
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "reasoning":
            thinking.append(_reasoning_text(item, i))
        elif kind == "message":
            role = {"developer": "system"}.get(item.get("role"), item.get("role"))
            if role not in ("user", "assistant", "system"):
                raise ApiError(400, f"input[{i}].role {item.get('role')!r} is not one of user, assistant, system, "
                               "developer", "invalid_request", "input")
            messages.append({"role": role, "content": _text(item.get("content"), f"input[{i}].content")})
        elif kind == "function_call":
            call = {"id": _field(item, "call_id", i), "type": "function",
                    "function": {"name": _field(item, "name", i), "arguments": _field(item, "arguments", i)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and not thinking:
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _field(item, "call_id", i),
                             "content": _text(item.get("output"), f"input[{i}].output")})
        else:
            raise ApiError(400, f"input[{i}] of type {kind!r} is not supported (message, reasoning, function_call "
                           "and function_call_output are)", "invalid_request", "input")
        if thinking and kind != "reasoning" and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"] = "".join(thinking)
            thinking = []
    return messages


def _reasoning_text(item: dict, i: int) -> str:
    """A reasoning item's thinking: its reasoning_text parts (an encrypted one cannot be read here: a 400)."""
    if item.get("encrypted_content"):
        raise ApiError(400, f"input[{i}].encrypted_content: this server keeps no encrypted thinking",
                       "invalid_request", "input")
    parts = item.get("content") or []
    if not isinstance(parts, list) or any(not isinstance(p, dict) or p.get("type") != "reasoning_text"
                                          or not isinstance(p.get("text"), str) for p in parts):
        raise ApiError(400, f"input[{i}].content: a reasoning item's content is reasoning_text parts",
                       "invalid_request", "input")
    return "".join(p["text"] for p in parts)


def _field(item: dict, name: str, i: int) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise ApiError(400, f"input[{i}].{name} must be a string", "invalid_request", "input")
    return value


def _text(content, where: str) -> str | list[dict]:
    """A string, or text parts (input_text / output_text) joined; with `input_image` parts, chat parts in order (an
    image as an `image_url` part named by its path here); files and audio are a 400."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where} must be a string or a list of text parts", "invalid_request", "input")
    parts = []
    for j, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") == "input_image":
            parts.append(image_part(part, f"{where}[{j}]"))
            continue
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ApiError(400, f"{where}: only text and input_image parts are supported, got {kind!r}",
                           "invalid_request", "input")
        parts.append({"type": "text", "text": part["text"]})
    if all(part["type"] == "text" for part in parts):
        return "".join(part["text"] for part in parts)
    return parts


def image_part(part: dict, where: str) -> dict:
    """An `input_image` part -> a chat `image_url` part (its URL: a data: URL, or one the server may fetch)."""
    unknown = sorted(set(part) - {"type", "image_url", "detail"})
    if unknown or not isinstance(part.get("image_url"), str):
        what = f"fields {unknown} are not served" if unknown else "needs image_url (a data: URL)"
        raise ApiError(400, f"{where}: input_image {what}", "invalid_image", where)
    detail = {"detail": part["detail"]} if part.get("detail") is not None else {}
    return {"type": "image_url", "image_url": {"url": part["image_url"], **detail}, WHERE_KEY: where}


class Answer:
    """One response being written: its output items, the response object, the streamed events, the record."""

    def __init__(self, ctx: ServerContext, store: ResponseStore, body: ResponsesRequest, prepared, conversation,
                 owner: str | None = None):
        self.ctx, self.store, self.body, self.prepared = ctx, store, body, prepared
        self.conversation, self.owner = conversation, owner
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.sequence_number = 0

    def response(self, status: str, blocks: list[Block], result=None) -> dict:
        body = self.body
        usage = None
        if result is not None:
            usage = {"input_tokens": result.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                     "output_tokens": result.completion_tokens,
                     "output_tokens_details": {"reasoning_tokens": result.reasoning_tokens},
                     "total_tokens": result.prompt_tokens + result.completion_tokens}
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        choice = body.tool_choice
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.prepared.model, "output": [output_item(b, "completed") for b in blocks],
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "previous_response_id": body.previous_response_id, "temperature": body.temperature,
            "top_p": body.top_p, "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "tool_choice": choice.model_dump() if choice is not None and not isinstance(choice, str)
            else (choice or "auto"),
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "text": {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)}
            if body.text is not None and body.text.format is not None else {"format": {"type": "text"}},
            "reasoning": {"effort": body.reasoning.effort if body.reasoning is not None else None, "summary": None},
            "store": body.store, "truncation": "disabled", "metadata": {}, "error": None,
            "incomplete_details": incomplete, "usage": usage,
        }

    async def finish(self, blocks: list[Block], result) -> dict:
        """The final response object; stored (with the conversation it ends) when `store` is on."""
        status = {"length": "incomplete", "abort": "cancelled"}.get(result.reason, "completed")
        response = self.response(status, blocks, result)
        if self.body.store:
            messages = self.conversation + assistant_messages(blocks)
            await asyncio.to_thread(self.store.put, self.id, {"response": response, "messages": messages},
                                    self.owner)
        return response

    def event(self, event_type: str, **data) -> str:
        self.sequence_number += 1
        return sse_event(event_type, {"type": event_type, "sequence_number": self.sequence_number - 1, **data})

    async def events(self, source):
        """The streamed response: created, in_progress, each output item's events, then completed/incomplete."""
        yield self.event("response.created", response=self.response("in_progress", []))
        yield self.event("response.in_progress", response=self.response("in_progress", []))
        stream = BlockStream(self.ctx, self.prepared)
        try:
            async for output in source:
                for kind, block, text in stream.feed(output):
                    for event in self.block_events(kind, block, text):
                        yield event
        except EngineError as exc:
            yield self.event("error", code="engine_error", message=str(exc), param=None)
            return
        if stream.result is None:
            return
        response = await self.finish(stream.blocks, stream.result)
        yield self.event(f"response.{response['status']}", response=response)

    def block_events(self, kind: str, block: Block, text: str) -> list[str]:
        where = {"item_id": item_id(block), "output_index": block.index}
        part = {"type": "output_text", "text": block.text, "annotations": [], "logprobs": []}
        if kind == "open":
            events = [self.event("response.output_item.added", output_index=block.index,
                                 item=output_item(block, "in_progress"))]
            if block.kind == "text":
                events.append(self.event("response.content_part.added", **where, content_index=0,
                                         part={**part, "text": ""}))
            return events
        if kind == "delta" and block.kind == "reasoning":
            return [self.event("response.reasoning_text.delta", **where, content_index=0, delta=text)]
        if kind == "delta" and block.kind == "text":
            return [self.event("response.output_text.delta", **where, content_index=0, delta=text, logprobs=[])]
        if kind == "delta":
            return [self.event("response.function_call_arguments.delta", **where, delta=text)]
        if block.kind == "reasoning":
            done = [self.event("response.reasoning_text.done", **where, content_index=0, text=block.text)]
        elif block.kind == "text":
            done = [self.event("response.output_text.done", **where, content_index=0, text=block.text, logprobs=[]),
                    self.event("response.content_part.done", **where, content_index=0, part=part)]
        else:
            done = [self.event("response.function_call_arguments.done", **where, name=block.name,
                               arguments=block.text)]
        return [*done, self.event("response.output_item.done", output_index=block.index,
                                  item=output_item(block, "completed"))]


def item_id(block: Block) -> str:
    return {"reasoning": "rs_", "text": "msg_", "tool": "fc_"}[block.kind] + block.item_id


def output_item(block: Block, status: str) -> dict:
    if block.kind == "reasoning":  # (the thinking whole, as OpenAI gives an open model's; no summary)
        content = [{"type": "reasoning_text", "text": block.text}] if status == "completed" else []
        return {"type": "reasoning", "id": item_id(block), "summary": [], "content": content, "status": status}
    if block.kind == "text":
        text = block.text if status == "completed" else ""
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text else []
        return {"type": "message", "id": item_id(block), "status": status, "role": "assistant", "content": content}
    return {"type": "function_call", "id": item_id(block), "call_id": block.call_id, "name": block.name,
            "arguments": block.text if status == "completed" else "", "status": status}


def assistant_messages(blocks: list[Block]) -> list[dict]:
    """The answer as the chat message that continues the conversation (what `previous_response_id` recalls)."""
    if not blocks:
        return [{"role": "assistant", "content": ""}]
    text = "".join(b.text for b in blocks if b.kind == "text")
    thinking = "".join(b.text for b in blocks if b.kind == "reasoning")
    calls = [{"id": b.call_id, "type": "function", "function": {"name": b.name, "arguments": b.text}}
             for b in blocks if b.kind == "tool"]
    return [{"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {}),
             **({"reasoning_content": thinking} if thinking else {})}]
