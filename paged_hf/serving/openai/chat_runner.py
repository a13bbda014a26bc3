"""Runs a request of another API (Responses, Anthropic Messages) through the chat-completions path.

Those routes translate their request into a `ChatCompletionRequest` and hand it here: the same chat template
rendering off the event loop, the same sampling-field checks, reasoning and tool-call parsers and grammar engine
as /v1/chat/completions, so the same conversation gets the same tokens. What comes back is a list of output
blocks (thinking, text, tool calls) that each route writes in its own wire format; a stream gets the blocks as
they open, grow and close (`BlockStream`).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from pydantic import ValidationError

from paged_hf.serving.openai.completions import last_output
from paged_hf.serving.openai.engine_loop import EngineError
from paged_hf.serving.openai.errors import ApiError, validation_message
from paged_hf.serving.openai.lifecycle import AbortingStreamingResponse
from paged_hf.serving.openai.logprobs import Deltas
from paged_hf.serving.openai.protocol import ChatCompletionRequest
from paged_hf.serving.openai.reasoning import request_outputs
from paged_hf.serving.openai.serving import Prepared, ServerContext, outputs, prepare_off_loop, submit
from paged_hf.serving.openai.tool_calls import ToolCallStreamer, parse_output, parser_for


@dataclass
class Block:
    """One piece of the answer: the thinking (with --reasoning-parser), text, or one tool call (`call_id`,
    `name`, JSON `text` of its arguments)."""

    kind: str  # "reasoning" | "text" | "tool"
    index: int
    text: str = ""
    call_id: str | None = None
    name: str | None = None
    item_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    closed: bool = False


@dataclass
class Finished:
    """How a sequence ended: "stop", "length", "tool_calls" or "abort"; `stop_string`: the stop string it met."""

    reason: str | None
    stop_string: str | None
    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int = 0  # of completion_tokens, the thinking's (with --reasoning-parser)


def chat_request(fields: dict) -> ChatCompletionRequest:
    """The translated request, checked by the chat route's own model (a 400 naming the field)."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        message, param = validation_message(exc)
        raise ApiError(400, message, "invalid_request", param) from None


async def start(ctx: ServerContext, request: ChatCompletionRequest, http_request):
    """-> (prepared, its engine request stream's outputs), after the checks (a 4xx before anything is queued)."""
    prepared = await prepare_off_loop(ctx, request, True, time.monotonic(), http_request)
    streams = await submit(ctx, prepared, reserved=True)
    return prepared, outputs(ctx, http_request, streams[0], prepared.stream)


async def final_blocks(ctx: ServerContext, prepared: Prepared, source) -> tuple[list[Block], Finished]:
    """The whole answer of a non-streamed request: its content and tool calls as blocks."""
    try:
        output = await last_output(source)
    except EngineError as exc:
        raise ApiError(500, str(exc), "engine_error") from None
    if output is None:  # the client went away; nobody reads this
        raise ApiError(499, "client disconnected", "client_disconnected")
    completion = output.outputs[0]
    thinking = request_outputs(prepared, ctx.tokenizer)
    reasoning, answer = thinking.split(completion) if thinking is not None else (None, completion)
    content, calls = parse_output(prepared.tools, parser_for(ctx.settings.tool_call_parser), ctx.tokenizer, answer)
    blocks = [Block("reasoning", 0, reasoning)] if reasoning and prepared.include_reasoning else []
    blocks += [Block("text", len(blocks), content)] if content else []
    blocks += [Block("tool", len(blocks) + i, call.function.arguments, call.id, call.function.name)
               for i, call in enumerate(calls)]
    reason = "tool_calls" if calls and completion.finish_reason == "stop" else completion.finish_reason
    return blocks, finished(prepared, completion, reason, thinking)


def finished(prepared: Prepared, completion, reason: str | None, thinking=None) -> Finished:
    stop = completion.stop_reason if isinstance(completion.stop_reason, str) else None
    reasoning = thinking.num_reasoning_tokens(completion) if thinking is not None else 0
    return Finished(reason, stop, len(prepared.prompt_token_ids), len(completion.token_ids), reasoning)


class BlockStream:
    """The chat path's streamed deltas (content, tool-call deltas) as blocks: ("open" | "delta" | "close", block,
    new text) events, in order; a block closes when the next one opens or the sequence ends."""

    def __init__(self, ctx: ServerContext, prepared: Prepared):
        self.deltas = Deltas()
        self.tools = None
        if prepared.tools.kind != "none":
            self.tools = ToolCallStreamer(prepared.tools, parser_for(ctx.settings.tool_call_parser), ctx.tokenizer)
        self.thinking = request_outputs(prepared, ctx.tokenizer)
        self.prepared = prepared
        self.blocks: list[Block] = []
        self.result: Finished | None = None

    def feed(self, output) -> list[tuple[str, Block, str]]:
        events = []
        for c, text, _, _ in self.deltas.new_pieces(output):
            reasoning, content, answer, calls, reason = None, text, c, None, c.finish_reason
            if self.thinking is not None:
                reasoning, content, answer = self.thinking.delta(c, text)
            if reasoning and self.prepared.include_reasoning:
                events += self._grow("reasoning", reasoning)
            if self.tools is not None:
                content, calls, reason = self.tools.delta(answer, content or "")
            if content:
                events += self._grow("text", content)
            for call in calls or []:
                if call.id is not None:  # a new call
                    events += self._open(Block("tool", len(self.blocks), "", call.id, call.function.name))
                events += self._grow("tool", call.function.arguments or "")
            if c.finish_reason is not None:
                events += self._close()
                self.result = finished(self.prepared, c, reason, self.thinking)
        return events

    def _grow(self, kind: str, text: str) -> list:
        events = []
        if not self.blocks or self.blocks[-1].kind != kind or self.blocks[-1].closed:
            events += self._open(Block(kind, len(self.blocks)))
        block = self.blocks[-1]
        if text:
            block.text += text
            events.append(("delta", block, text))
        return events

    def _open(self, block: Block) -> list:
        events = self._close()
        self.blocks.append(block)
        return [*events, ("open", block, "")]

    def _close(self) -> list:
        if not self.blocks or self.blocks[-1].closed:
            return []
        self.blocks[-1].closed = True
        return [("close", self.blocks[-1], "")]


def sse_response(ctx: ServerContext, prepared: Prepared, body) -> AbortingStreamingResponse:
    """A server-sent-events response that aborts the engine request however it ends."""
    return AbortingStreamingResponse(body, ctx.engine, prepared.request_id, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def sse_event(event_type: str, data: dict) -> str:
    return f"event: {event_type}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


def tool_arguments(block: Block):
    """A tool call's arguments as a JSON object (a cut or malformed call: its text under "_raw")."""
    try:
        value = json.loads(block.text or "{}")
    except ValueError:
        return {"_raw": block.text}
    return value if isinstance(value, dict) else {"_raw": block.text}
