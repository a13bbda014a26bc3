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
from paged_hf.serving.openai.engine_loop import EngineError, QueueFullError, RequestStream
from paged_hf.serving.openai.errors import ApiError
from paged_hf.serving.openai.protocol import (
    ChatCompletionRequest,
    ChatLogprobs,
    CompletionLogprobs,
    CompletionRequest,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from paged_hf.serving.openai.structured import structured_outputs
from paged_hf.serving.openai.tool_calls import ToolMode, parser_for, template_messages, tool_mode

#: How often a request waiting for tokens checks whether its client is still there.
DISCONNECT_POLL_S = 0.5


@dataclass
class Prepared:
    """A checked request, ready for the engine."""

    request_id: str
    model: str
    adapter: str | None
    prompts: list[list[int]]  # token ids; several for a batched /v1/completions request
    params: SamplingParams
    stream: bool
    include_usage: bool
    chat: bool
    arrival_time: float
    tools: ToolMode = field(default_factory=ToolMode)
    cache_salt: str | None = None
    echo: bool = False  # /v1/completions: the prompt comes back before the completion
    echo_only: bool = False  # echo with max_tokens=0: the prompt alone (one token is computed and dropped)
    prompt_texts: list[str | None] = field(default_factory=list)  # the prompts as sent (echo)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.prompts[0]

    def engine_request_id(self, index: int) -> str:
        return self.request_id if len(self.prompts) == 1 else f"{self.request_id}-{index}"


@dataclass
class ServerContext:
    """What the handlers need: the engine loop, the tokenizer, the served names and the limits."""

    engine: object  # EngineLoop
    tokenizer: object
    model_name: str
    settings: object  # ServerSettings
    max_model_len: int
    metrics: object  # ServerMetrics
    served_names: tuple[str, ...] = ()  # every name of the base model (--served-model-name a b ...)

    def resolve_model(self, name: str | None) -> str | None:
        """Model name -> adapter (None = the base model). Adapters are served under their own names."""
        if name is None or name == self.model_name or name in self.served_names:
            return None
        if name in self.engine.adapter_names:
            return name
        raise ApiError(404, f"The model {name!r} does not exist; served: "
                       f"{[*(self.served_names or (self.model_name,)), *self.engine.adapter_names]}", "model_not_found",
                       "model")


def completion_prompts(request: CompletionRequest, tokenizer) -> list[str | list[int]]:
    """The request's prompts: one string or token-id list, or a list of them (a batch)."""
    prompt = request.prompt
    if isinstance(prompt, str) or isinstance(prompt[0], int):
        return [prompt]
    if any(not p for p in prompt):
        raise ApiError(400, "a prompt of the batch is empty", "invalid_prompt", "prompt")
    return list(prompt)


def prompt_ids(prompt: str | list[int], tokenizer, add_special_tokens: bool) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ApiError(400, "this server has no tokenizer: send token ids", "invalid_prompt", "prompt")
        return list(tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])
    return list(prompt)


def chat_prompt_ids(request: ChatCompletionRequest, tokenizer, tools: ToolMode | None = None,
                    tool_call_parser: str = "hermes", chat_template: str | None = None) -> list[int]:
    """The chat template (the request's, the server's --chat-template, or the tokenizer's), rendered with the
    request's options and tools, then tokenized (special tokens added only if asked: the template holds them)."""
    template = request.chat_template or chat_template or getattr(tokenizer, "chat_template", None)
    if tokenizer is None or not (template or getattr(tokenizer, "chat_template", None)):
        raise ApiError(400, "this model has no chat template: use /v1/completions", "no_chat_template", "messages")
    if request.add_generation_prompt and request.continue_final_message:
        raise ApiError(400, "continue_final_message and add_generation_prompt cannot both be true",
                       "invalid_request", "continue_final_message")
    try:
        messages = [{**message.model_dump(exclude_none=True), "content": message.text()}
                    for message in request.messages]
        messages, extra = template_messages(messages, tools or ToolMode(), parser_for(tool_call_parser), template)
        text = tokenizer.apply_chat_template(
            messages, chat_template=template, add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message, tokenize=False,
            **extra, **(request.chat_template_kwargs or {}))
    except ApiError:
        raise
    except Exception as exc:  # noqa: BLE001 - a template error is about these messages: the client's
        raise ApiError(400, f"the chat messages do not fit the chat template: {exc}", "invalid_messages",
                       "messages") from None
    return prompt_ids(text, tokenizer, bool(request.add_special_tokens))


def truncate(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep the last `keep` tokens (-1: as many as the context holds)."""
    if keep is None:
        return ids
    keep = max_model_len if keep == -1 else keep
    return ids[-keep:] if keep else []


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
    if max_tokens == 0:  # echo only (checked in prepare): one token is computed and dropped
        max_tokens = 1
    max_tokens = _max_tokens(max_tokens, num_prompt_tokens, ctx, prompt_field,
                             settings.sampling_defaults.get("max_tokens"))
    try:
        return SamplingParams(max_new_tokens=max_tokens, structured_outputs=_grammar(request, tools),
                              **_logprob_fields(request, chat), **_sampling_fields(request, settings.sampling_defaults))
    except ValueError as exc:
        raise ApiError(400, str(exc), "invalid_sampling_params") from None


def _sampling_fields(request, defaults: dict) -> dict:
    """The SamplingParams fields that come straight from the request; one it leaves unset takes the model's
    generation_config default (sampling_defaults.py), else SamplingParams' own (temperature: OpenAI's 1.0)."""
    defaults = {"temperature": 1.0, **defaults}
    optional = {name: getattr(request, name) if getattr(request, name) is not None else defaults.get(name)
                for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}
    optional = {name: value for name, value in optional.items() if value is not None}
    return dict(
        min_new_tokens=request.min_tokens,
        presence_penalty=request.presence_penalty, frequency_penalty=request.frequency_penalty, n=request.n,
        seed=request.seed, stop=request.stop, stop_token_ids=request.stop_token_ids, ignore_eos=request.ignore_eos,
        logit_bias=request.logit_bias, allowed_token_ids=request.allowed_token_ids, bad_words=request.bad_words,
        include_stop_str_in_output=request.include_stop_str_in_output,
        skip_special_tokens=request.skip_special_tokens, **optional)


def _logprob_fields(request, chat: bool) -> dict:
    """logprobs (chat: top_logprobs when logprobs=true) and prompt_logprobs (echo asks for them as vLLM)."""
    logprobs = request.logprobs
    if chat:
        if request.top_logprobs is not None and not request.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", "invalid_logprobs", "top_logprobs")
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
    prompt_logprobs = request.prompt_logprobs
    if prompt_logprobs is None and not chat and request.echo:
        prompt_logprobs = logprobs
    if prompt_logprobs is not None and request.stream:
        raise ApiError(400, "prompt logprobs (prompt_logprobs, or echo with logprobs) are not available with "
                       "stream=true", "invalid_request", "prompt_logprobs")
    return dict(logprobs=logprobs, prompt_logprobs=prompt_logprobs)


def _grammar(request, tools: ToolMode | None):
    """The request's grammar: from response_format / structured_outputs, or the tool_choice it enforces."""
    spec = structured_outputs(request)
    tool_spec = tools.structured_outputs() if tools is not None else None
    if spec is not None and tool_spec is not None:
        raise ApiError(400, f"tool_choice {tools.kind!r} is enforced with its own schema: drop response_format "
                       "and structured_outputs", "invalid_request", "tool_choice")
    return spec or tool_spec


def _max_tokens(requested: int | None, num_prompt_tokens: int, ctx: ServerContext, prompt_field: str,
                default: int | None = None) -> int:
    """Default: the rest of the context (or the model's generation_config max_new_tokens when smaller), capped by
    --max-tokens-cap. More than the cap or the context: 400."""
    room = ctx.max_model_len - num_prompt_tokens
    cap = ctx.settings.max_tokens_cap
    if requested is None:
        return min(x for x in (room, cap, default) if x)
    if cap and requested > cap:
        raise ApiError(400, f"max_tokens={requested} is more than this server allows ({cap})", "invalid_max_tokens",
                       "max_tokens")
    if requested > room:
        raise ApiError(400, f"This model's maximum context length is {ctx.max_model_len} tokens. However, you "
                       f"requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the {prompt_field}, "
                       f"{requested} for the completion)", "context_length_exceeded", "max_tokens")
    return requested


def engine_prompt_ids(request, tokenizer, chat: bool, max_model_len: int, chat_template: str | None = None,
                      tool_call_parser: str = "hermes", tools: ToolMode | None = None) -> tuple[list, list[list[int]]]:
    """-> (the request's prompts as sent, the token ids the engine gets for each: chat template with the
    request's options and tools, special tokens, truncate_prompt_tokens). The server and the Ray ingress's
    prefix-aware routing both use this, so that the routing hashes exactly what the engine will cache."""
    if chat:
        tools = tools if tools is not None else tool_mode(request)
        prompts = [chat_prompt_ids(request, tokenizer, tools, tool_call_parser, chat_template)]
    else:
        prompts = completion_prompts(request, tokenizer)
    add_special = request.add_special_tokens if request.add_special_tokens is not None else not chat
    ids = [truncate(prompt_ids(p, tokenizer, add_special), request.truncate_prompt_tokens, max_model_len)
           for p in prompts]
    return prompts, ids


def prepare(request, ctx: ServerContext, chat: bool, arrival_time: float) -> Prepared:
    adapter = ctx.resolve_model(request.model)
    tools = tool_mode(request) if chat else ToolMode()
    if not chat:
        if request.echo and request.stream:
            raise ApiError(400, "echo is not available with stream=true", "invalid_request", "echo")
        if request.max_tokens == 0 and not request.echo:
            raise ApiError(400, "max_tokens=0 needs echo=true", "invalid_max_tokens", "max_tokens")
    prompts, ids = engine_prompt_ids(request, ctx.tokenizer, chat, ctx.max_model_len, ctx.settings.chat_template,
                                     ctx.settings.tool_call_parser, tools)
    if any(not p for p in ids):
        raise ApiError(400, "the prompt is empty", "invalid_prompt", "messages" if chat else "prompt")
    params = sampling_params(request, max(len(p) for p in ids), ctx, chat, tools)
    prefix = "chatcmpl" if chat else "cmpl"
    options = request.stream_options
    echo = not chat and request.echo
    texts = [p if isinstance(p, str) else None for p in prompts] if echo else []
    return Prepared(f"{prefix}-{uuid.uuid4().hex}", request.model or ctx.model_name, adapter, ids, params,
                    request.stream, bool(request.stream and options and options.include_usage), chat, arrival_time,
                    cache_salt=request.cache_salt, echo=echo, echo_only=echo and request.max_tokens == 0,
                    prompt_texts=texts, tools=tools)


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


async def submit(ctx: ServerContext, prepared: Prepared, reserved: bool = False) -> list[RequestStream]:
    """One engine request per prompt; if one is refused, those already queued are aborted. `reserved`: the
    first prompt's --max-queue slot is already taken (prepare_off_loop); the others take their own."""
    streams = []
    try:
        for index, ids in enumerate(prepared.prompts):
            streams.append(await ctx.engine.submit(prepared.engine_request_id(index), ids, prepared.params,
                                                   prepared.adapter, prepared.arrival_time,
                                                   reserved=reserved and index == 0, cache_salt=prepared.cache_salt))
    except (QueueFullError, ValueError) as exc:
        for stream in streams:
            ctx.engine.abort(stream.request_id)
        if isinstance(exc, QueueFullError):
            raise ApiError(503, str(exc), "server_overloaded") from None
        raise ApiError(400, str(exc), "invalid_request") from None
    for ids in prepared.prompts:
        ctx.metrics.count_request(prepared.model, prepared.adapter, len(ids))
    return streams


async def outputs(ctx: ServerContext, http_request, stream: RequestStream, streaming: bool) -> AsyncIterator:
    """The request's outputs until it finishes. Leaving early (client gone, cancelled, error) aborts it, so its
    blocks are freed at the engine's next step. While nothing is being sent (a non-streamed request, or a
    streamed one before its first output) the client's going away is polled for; once chunks flow, the
    streaming response notices it and cancels this generator, so the poll stops."""
    finished = False
    polling = True
    loop = asyncio.get_running_loop()
    next_check = loop.time() + DISCONNECT_POLL_S
    try:
        while True:
            item = await stream.get(max(0.01, next_check - loop.time()) if polling else None)
            if polling and loop.time() >= next_check:  # by the clock: outputs may arrive every step
                if await http_request.is_disconnected():
                    return
                next_check = loop.time() + DISCONNECT_POLL_S
            if item is None:
                continue
            if isinstance(item, EngineError):
                finished = True  # the engine already dropped it
                raise item
            polling = not streaming
            yield item
            if item.finished:
                finished = True
                return
    finally:
        if not finished:
            ctx.engine.abort(stream.request_id)


def usage(prepared: Prepared, *outputs) -> Usage:
    """Over every prompt of the request (an echo-only completion generated nothing)."""
    num_generated = 0 if prepared.echo_only else sum(len(c.token_ids) for o in outputs for c in o.outputs)
    num_prompt = sum(len(ids) for ids in prepared.prompts)
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


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)


def _top(entry: dict, k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda item: -item[1])[:k]


def chat_logprobs(tokenizer, token_ids: list[int], entries: list, k: int) -> ChatLogprobs:
    content = []
    for token_id, entry in zip(token_ids, entries):
        text = token_text(tokenizer, token_id)
        top = [TopLogprob(token=piece, logprob=lp, bytes=list(piece.encode()))
               for piece, lp in ((token_text(tokenizer, t), lp) for t, lp in _top(entry, k))]
        content.append(TokenLogprob(token=text, logprob=entry.get(token_id, float("-inf")), bytes=list(text.encode()),
                                    top_logprobs=top))
    return ChatLogprobs(content=content)


def completion_logprobs(tokenizer, token_ids: list[int], entries: list, k: int, offset: int) -> CompletionLogprobs:
    result = CompletionLogprobs()
    for token_id, entry in zip(token_ids, entries):
        text = token_text(tokenizer, token_id)
        result.tokens.append(text)
        result.token_logprobs.append(entry.get(token_id))
        result.top_logprobs.append({token_text(tokenizer, t): lp for t, lp in _top(entry, k)} if k else None)
        result.text_offset.append(offset)
        offset += len(text)
    return result
