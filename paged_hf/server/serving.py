"""From an OpenAI request to engine inputs, and from the engine's outputs back to OpenAI responses.

Everything a client can get wrong is checked here, before the engine sees the request, so the answer is a
400/404 that names the field, and nothing is queued. The engine's own `ValueError` (e.g. a token id outside
the vocabulary) is the last line of defence and is a 400 too.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from paged_hf.sampling_params import SamplingParams

from .engine_loop import EngineError, QueueFullError, RequestStream
from .errors import ApiError
from .structured import structured_outputs
from .tool_calls import ToolMode, parser_for, template_messages, tool_mode
from .protocol import (ChatCompletionRequest, ChatLogprobs, CompletionLogprobs, CompletionRequest, TokenLogprob,
                       TopLogprob, Usage)

#: How often a request waiting for tokens checks whether its client is still there.
DISCONNECT_POLL_S = 0.5


@dataclass
class Prepared:
    """A checked request, ready for the engine."""

    request_id: str
    model: str
    adapter: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    chat: bool
    arrival_time: float
    tools: ToolMode = field(default_factory=ToolMode)


@dataclass
class ServerContext:
    """What the handlers need: the engine loop, the tokenizer, the served names and the limits."""

    engine: object  # EngineLoop
    tokenizer: object
    model_name: str
    settings: object  # ServerSettings
    max_model_len: int
    metrics: object  # ServerMetrics

    def resolve_model(self, name: str | None) -> str | None:
        """Model name -> adapter (None = the base model). Adapters are served under their own names."""
        if name is None or name == self.model_name:
            return None
        if name in self.engine.adapter_names:
            return name
        raise ApiError(404, f"The model {name!r} does not exist; served: "
                       f"{[self.model_name, *self.engine.adapter_names]}", "model_not_found", "model")


def completion_prompt_ids(request: CompletionRequest, tokenizer) -> list[int]:
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise ApiError(400, "batched prompts are not supported: send one prompt per request",
                           "invalid_prompt", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ApiError(400, "this server has no tokenizer: send token ids", "invalid_prompt", "prompt")
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    return list(prompt)


def chat_prompt_ids(request: ChatCompletionRequest, tokenizer, tools: ToolMode | None = None,
                    tool_call_parser: str = "hermes") -> list[int]:
    """The chat template with the assistant's turn opened (add_generation_prompt=True), with the tools."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, "this model has no chat template: use /v1/completions", "no_chat_template", "messages")
    try:
        messages = [{**message.model_dump(exclude_none=True), "content": message.text()}
                    for message in request.messages]
        messages, extra = template_messages(messages, tools or ToolMode(), parser_for(tool_call_parser),
                                            tokenizer.chat_template)
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False,
                                            **extra)
    except ApiError:
        raise
    except Exception as exc:  # noqa: BLE001 - a template error is about these messages: the client's
        raise ApiError(400, f"the chat messages do not fit the chat template: {exc}", "invalid_messages",
                       "messages") from None
    return list(ids)


def sampling_params(request, num_prompt_tokens: int, ctx: ServerContext, chat: bool,
                    tools: ToolMode | None = None) -> SamplingParams:
    settings = ctx.settings
    prompt_field = "messages" if chat else "prompt"
    if num_prompt_tokens >= ctx.max_model_len:
        raise ApiError(400, f"The prompt has {num_prompt_tokens} tokens; this model's maximum context length is "
                       f"{ctx.max_model_len} tokens, which leaves no room for an answer", "context_length_exceeded",
                       prompt_field)
    if request.n > settings.max_n:
        raise ApiError(400, f"n={request.n} is more than this server allows ({settings.max_n})", "invalid_n", "n")
    if getattr(request, "best_of", None) not in (None, request.n):
        raise ApiError(400, "best_of other than n is not supported", "invalid_best_of", "best_of")
    max_tokens = (request.max_completion_tokens or request.max_tokens) if chat else request.max_tokens
    max_tokens = _max_tokens(max_tokens, num_prompt_tokens, ctx, prompt_field)
    logprobs = request.logprobs
    if chat:
        if request.top_logprobs is not None and not request.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", "invalid_logprobs", "top_logprobs")
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
    optional = {name: getattr(request, name) for name in ("top_p", "top_k", "min_p", "repetition_penalty")
                if getattr(request, name) is not None}
    try:
        return SamplingParams(
            max_new_tokens=max_tokens, temperature=1.0 if request.temperature is None else request.temperature,
            presence_penalty=request.presence_penalty, frequency_penalty=request.frequency_penalty, n=request.n,
            seed=request.seed, stop=request.stop, ignore_eos=request.ignore_eos, logprobs=logprobs,
            structured_outputs=_grammar(request, tools), **optional)
    except ValueError as exc:
        raise ApiError(400, str(exc), "invalid_sampling_params") from None


def _grammar(request, tools: ToolMode | None):
    """The request's grammar: from response_format / structured_outputs, or the tool_choice it enforces."""
    spec = structured_outputs(request)
    tool_spec = tools.structured_outputs() if tools is not None else None
    if spec is not None and tool_spec is not None:
        raise ApiError(400, f"tool_choice {tools.kind!r} is enforced with its own schema: drop response_format "
                       "and structured_outputs", "invalid_request", "tool_choice")
    return spec or tool_spec


def _max_tokens(requested: int | None, num_prompt_tokens: int, ctx: ServerContext, prompt_field: str) -> int:
    """Default: the rest of the context, capped by --max-tokens-cap. More than the cap or the context: 400."""
    room = ctx.max_model_len - num_prompt_tokens
    cap = ctx.settings.max_tokens_cap
    if requested is None:
        return min(room, cap) if cap else room
    if cap and requested > cap:
        raise ApiError(400, f"max_tokens={requested} is more than this server allows ({cap})", "invalid_max_tokens",
                       "max_tokens")
    if requested > room:
        raise ApiError(400, f"This model's maximum context length is {ctx.max_model_len} tokens. However, you "
                       f"requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the {prompt_field}, "
                       f"{requested} for the completion)", "context_length_exceeded", "max_tokens")
    return requested


def prepare(request, ctx: ServerContext, chat: bool, arrival_time: float) -> Prepared:
    adapter = ctx.resolve_model(request.model)
    tools = tool_mode(request) if chat else ToolMode()
    parser = getattr(ctx.settings, "tool_call_parser", "hermes")
    ids = (chat_prompt_ids(request, ctx.tokenizer, tools, parser) if chat
           else completion_prompt_ids(request, ctx.tokenizer))
    params = sampling_params(request, len(ids), ctx, chat, tools)
    prefix = "chatcmpl" if chat else "cmpl"
    options = request.stream_options
    return Prepared(f"{prefix}-{uuid.uuid4().hex}", request.model or ctx.model_name, adapter, ids, params,
                    request.stream, bool(request.stream and options and options.include_usage), chat, arrival_time,
                    tools)


async def prepare_off_loop(ctx: ServerContext, request, chat: bool, arrival_time: float) -> Prepared:
    """`prepare` in a worker thread, after the request took its --max-queue slot: tokenizing a large prompt or
    rendering a chat template takes seconds, and on the event loop it would stall every stream and /health.
    The slot is given back if the request turns out bad; else `submit(..., reserved=True)` uses it."""
    try:
        ctx.engine.reserve()
    except QueueFullError as exc:
        raise ApiError(503, str(exc), "server_overloaded") from None
    try:
        return await asyncio.to_thread(prepare, request, ctx, chat, arrival_time)
    except BaseException:
        ctx.engine.release()
        raise


async def submit(ctx: ServerContext, prepared: Prepared, reserved: bool = False) -> RequestStream:
    try:
        stream = await ctx.engine.submit(prepared.request_id, prepared.prompt_token_ids, prepared.params,
                                         prepared.adapter, prepared.arrival_time, reserved=reserved)
    except QueueFullError as exc:
        raise ApiError(503, str(exc), "server_overloaded") from None
    except ValueError as exc:
        raise ApiError(400, str(exc), "invalid_request") from None
    ctx.metrics.count_request(prepared.model, prepared.adapter, len(prepared.prompt_token_ids))
    return stream


async def outputs(ctx: ServerContext, http_request, stream: RequestStream) -> AsyncIterator:
    """The request's outputs until it finishes. Leaving early (client gone, cancelled, error) aborts it, so its
    blocks are freed at the engine's next step."""
    finished = False
    loop = asyncio.get_running_loop()
    next_check = loop.time() + DISCONNECT_POLL_S
    try:
        while True:
            item = await _next_item(stream.queue, max(0.01, next_check - loop.time()))
            if loop.time() >= next_check:  # by the clock: outputs may arrive every step and never time out
                if await http_request.is_disconnected():
                    return
                next_check = loop.time() + DISCONNECT_POLL_S
            if item is None:
                continue
            if isinstance(item, EngineError):
                finished = True  # the engine already dropped it
                raise item
            yield item
            if item.finished:
                finished = True
                return
    finally:
        if not finished:
            ctx.engine.abort(stream.request_id)


async def _next_item(queue: asyncio.Queue, timeout: float):
    """The next output, or None after `timeout` seconds without one."""
    try:
        return queue.get_nowait()
    except asyncio.QueueEmpty:
        pass
    try:
        return await asyncio.wait_for(queue.get(), timeout=timeout)
    except asyncio.TimeoutError:
        return None


def usage(prepared: Prepared, output) -> Usage:
    num_generated = sum(len(c.token_ids) for c in output.outputs)
    num_prompt = len(prepared.prompt_token_ids)
    return Usage(prompt_tokens=num_prompt, completion_tokens=num_generated, total_tokens=num_prompt + num_generated)


# --- incremental text and logprobs ----------------------------------------------------------------------------

@dataclass
class Deltas:
    """What each sequence has already sent, so a stream sends only what is new.

    The engine's text only ever grows while a sequence runs (its detokenizer holds back what a stop string or
    half a multi-byte character could still change), so the new text is simply what follows the text sent.
    """

    text_sent: dict = field(default_factory=dict)  # index -> characters sent
    tokens_sent: dict = field(default_factory=dict)
    finish_sent: set = field(default_factory=set)  # indexes whose finish_reason went out (n > 1 finish apart)

    def text(self, completion) -> str:
        text, sent = completion.text or "", self.text_sent.get(completion.index, 0)
        self.text_sent[completion.index] = max(sent, len(text))
        return text[sent:]

    def tokens(self, completion) -> tuple[list[int], list]:
        start = self.tokens_sent.get(completion.index, 0)
        self.tokens_sent[completion.index] = len(completion.token_ids)
        return completion.token_ids[start:], (completion.logprobs or [])[start:]

    def new_pieces(self, output):
        """(completion, new text, new token ids, their logprob entries) of each sequence with something new
        to send: text, tokens, or its finish (sent once, though the output keeps listing finished sequences)."""
        for c in output.outputs:
            text = self.text(c)
            token_ids, entries = self.tokens(c)
            finishing = c.finish_reason is not None and c.index not in self.finish_sent
            if finishing:
                self.finish_sent.add(c.index)
            if text or token_ids or finishing:
                yield c, text, token_ids, entries


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)


def _top(entry: dict, k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda item: -item[1])[:k]


def chat_logprobs(tokenizer, token_ids: list[int], entries: list, k: int) -> ChatLogprobs:
    content = []
    for token_id, entry in zip(token_ids, entries):
        text = _token_text(tokenizer, token_id)
        top = [TopLogprob(token=piece, logprob=lp, bytes=list(piece.encode()))
               for piece, lp in ((_token_text(tokenizer, t), lp) for t, lp in _top(entry, k))]
        content.append(TokenLogprob(token=text, logprob=entry.get(token_id, float("-inf")), bytes=list(text.encode()),
                                    top_logprobs=top))
    return ChatLogprobs(content=content)


def completion_logprobs(tokenizer, token_ids: list[int], entries: list, k: int, offset: int) -> CompletionLogprobs:
    result = CompletionLogprobs()
    for token_id, entry in zip(token_ids, entries):
        text = _token_text(tokenizer, token_id)
        result.tokens.append(text)
        result.token_logprobs.append(entry.get(token_id))
        result.top_logprobs.append({_token_text(tokenizer, t): lp for t, lp in _top(entry, k)} if k else None)
        result.text_offset.append(offset)
        offset += len(text)
    return result
