"""From an OpenAI request to engine inputs, and from the engine's outputs back to OpenAI responses.

Everything a client can get wrong is checked here, before the engine sees the request, so the answer is a
400/404 that names the field, and nothing is queued. The engine's own `ValueError` (e.g. a token id outside
the vocabulary) is the last line of defence and is a 400 too.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid
from collections.abc import AsyncIterator

from paged_hf.sampling_params import SamplingParams
from paged_hf.serving.openai.chat_images import check_images, image_parts, image_prompt
from paged_hf.serving.openai.chat_template import TemplatePolicy, chat_prompt_ids
from paged_hf.serving.openai.context import Prepared, ServerContext
from paged_hf.serving.openai.engine_loop import EngineError, QueueFullError
from paged_hf.serving.openai.request_stream import RequestStream
from paged_hf.serving.openai.errors import ApiError
from paged_hf.serving.openai.memory import trim_if_large
from paged_hf.serving.openai.protocol import CompletionRequest, CompletionTokensDetails, PromptTokensDetails, Usage
from paged_hf.serving.openai.reasoning_request import reasoning_parser, thinking_params
from paged_hf.serving.openai.request_body import too_deep
from paged_hf.serving.openai.schema_limits import check_request_schemas
from paged_hf.serving.openai.structured import structured_outputs
from paged_hf.serving.openai.tenancy import owner_of, tenant_cache_salt
from paged_hf.serving.openai.tool_calls import ToolMode, tool_mode

#: How often a request waiting for tokens checks whether its client is still there.
DISCONNECT_POLL_S = 0.5


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
        ids = list(tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])
        trim_if_large(len(prompt))  # in a worker thread: its arena would keep the tokenizer's peak
        return ids
    return list(prompt)


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
                      tool_call_parser: str = "hermes", tools: ToolMode | None = None,
                      policy: TemplatePolicy | None = None, cancel: threading.Event | None = None,
                      parts: bool = False) -> tuple[list, list[list[int]]]:
    """-> (the request's prompts as sent, the token ids the engine gets for each: chat template with the
    request's options and tools, special tokens, truncate_prompt_tokens). The server and the Ray ingress's
    prefix-aware routing both use this, so that the routing hashes exactly what the engine will cache. `parts`: a
    processor's template (chat_template.render_chat)."""
    if chat:
        tools = tools if tools is not None else tool_mode(request)
        prompts = [chat_prompt_ids(request, tokenizer, tools, tool_call_parser, chat_template, policy, cancel, parts)]
    else:
        prompts = completion_prompts(request, tokenizer)
    add_special = request.add_special_tokens if request.add_special_tokens is not None else not chat
    ids = [truncate(prompt_ids(p, tokenizer, add_special), request.truncate_prompt_tokens, max_model_len)
           for p in prompts]
    return prompts, ids


def prepare(request, ctx: ServerContext, chat: bool, arrival_time: float,
            cancel: threading.Event | None = None, key_name: str | None = None) -> Prepared:
    adapter = ctx.resolve_model(request.model, owner_of(ctx.settings, key_name))
    check_request_schemas(request, ctx.max_schema_depth)
    tools = tool_mode(request) if chat else ToolMode()
    if not chat:
        if request.echo and request.stream:
            raise ApiError(400, "echo is not available with stream=true", "invalid_request", "echo")
        if request.max_tokens == 0 and not request.echo:
            raise ApiError(400, "max_tokens=0 needs echo=true", "invalid_max_tokens", "max_tokens")
    images = image_parts(request) if chat else []
    check_images(images, ctx)
    processed = image_prompt(request, ctx, images, tools, cancel) if images else None
    if processed is not None:
        prompts, ids = [None], [list(processed.token_ids)]
    else:
        prompts, ids = engine_prompt_ids(request, ctx.tokenizer, chat, ctx.max_model_len, ctx.chat_template,
                                         ctx.settings.tool_call_parser, tools, ctx.template_policy, cancel,
                                         parts=ctx.processor is not None)
    if any(not p for p in ids):
        raise ApiError(400, "the prompt is empty", "invalid_prompt", "messages" if chat else "prompt")
    params = sampling_params(request, max(len(p) for p in ids), ctx, chat, tools)
    reasoning = reasoning_parser(ctx, request, ids[0], params) if chat else None
    if chat:
        params = thinking_params(ctx, request, reasoning, params)
    check_logprob_entries(params, ids, ctx.settings.max_logprob_entries)
    prefix = "chatcmpl" if chat else "cmpl"
    options = request.stream_options
    echo = not chat and request.echo
    texts = [p if isinstance(p, str) else None for p in prompts] if echo else []
    return Prepared(f"{prefix}-{uuid.uuid4().hex}", request.model or ctx.model_name, adapter, ids, params,
                    request.stream, bool(request.stream and options and options.include_usage), chat, arrival_time,
                    cache_salt=request.cache_salt, echo=echo, echo_only=echo and request.max_tokens == 0,
                    prompt_texts=texts, tools=tools, reasoning=reasoning,
                    include_reasoning=not chat or request.include_reasoning, processed=processed)


async def prepare_off_loop(ctx: ServerContext, request, chat: bool, arrival_time: float,
                           http_request=None) -> Prepared:
    """`prepare` in a worker thread, after the request took its --max-queue slot: tokenizing a large prompt or
    rendering a chat template takes seconds, and on the event loop it would stall every stream and /health.
    Then `ready` (grammar, bad_words). A client that leaves meanwhile stops the render and frees the slot.
    The slot is given back if the request turns out bad; else `submit(..., reserved=True)` uses it."""
    try:
        ctx.engine.reserve()
    except QueueFullError as exc:
        raise ApiError(503, str(exc), "server_overloaded") from None
    cancel = threading.Event()
    key_name = request_key_name(http_request)
    try:
        prepared = await until_disconnected(asyncio.to_thread(prepare, request, ctx, chat, arrival_time, cancel,
                                                              key_name), http_request, cancel)
        await until_disconnected(ready(ctx, prepared), http_request, cancel)
        prepared.priority = getattr(request, "priority", 0) or 0
        prepared.tenant = getattr(request, "user", None) or key_name
        prepared.key_name = key_name
        return prepared
    except RecursionError:  # something the client sent nests deeper than a step of its preparation reaches
        ctx.engine.release()
        raise too_deep("too many levels", ctx.settings.max_json_depth) from None
    except BaseException as exc:
        ctx.engine.release()
        if isinstance(exc, ApiError) and exc.status_code == 499:  # left before it was queued: an abort
            ctx.metrics.count_finished("abort", 0, getattr(request, "n", 1))
        raise


def request_key_name(http_request) -> str | None:
    """The name of the API key the request came with (app.GuardMiddleware), or None."""
    state = getattr(http_request, "scope", {}).get("state") or {}
    return state.get("api_key_name")


async def until_disconnected(work, http_request, cancel: threading.Event):
    """`work`'s result; if the client leaves first, `cancel` is set (a render stops at its next line) and the
    answer is a 499 once the work ended."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            error = task.exception()
            if error is None:
                return task.result()
            task = done = None  # they hold the error, whose traceback will hold this frame: a cycle of every frame
            try:  # of the work (a megabyte request's text in them) that only a full collection would free
                raise error
            finally:
                error = None
        if http_request is not None and await http_request.is_disconnected():
            cancel.set()
            with contextlib.suppress(Exception):
                await task
            raise ApiError(499, "client disconnected", "client_disconnected")


async def ready(ctx: ServerContext, prepared: Prepared) -> None:
    """Do the request's slow engine-side work before it is queued, off the engine thread: its bad_words
    tokenized (in a worker thread) and its grammar compiled (on the compiler's pool, within its time limit).
    The engine then finds both ready. A 400 for a grammar that is too large, too slow or invalid."""
    try:
        preparation = await asyncio.to_thread(ctx.engine.generator.prepare, prepared.params)
        if preparation is None:
            return
        waiter = asyncio.wrap_future(preparation.future)
        done, _ = await asyncio.wait({waiter}, timeout=preparation.timeout_s)
        if not done:  # the compile goes on in its pool thread (it cannot be stopped); its result is dropped
            raise preparation.timed_out()
        waiter.result()
    except ValueError as exc:
        raise ApiError(400, str(exc), "invalid_request", "structured_outputs") from None


def check_logprob_entries(params: SamplingParams, ids: list[list[int]], limit: int) -> None:
    """Prompt logprobs are sent with each of the n choices: positions x (k + 1) x n entries, one JSON object
    each (~100 bytes). 400 above `limit` (--max-logprob-entries)."""
    if params.prompt_logprobs is None:
        return
    entries = sum(len(p) for p in ids) * (params.prompt_logprobs + 1) * params.n
    if entries > limit:
        raise ApiError(400, f"prompt logprobs would return {entries} entries (prompt tokens x (logprobs + 1) x n); "
                       f"at most {limit} are accepted (--max-logprob-entries)", "too_many_logprobs",
                       "prompt_logprobs")


async def submit(ctx: ServerContext, prepared: Prepared, reserved: bool = False) -> list[RequestStream]:
    """One engine request per prompt, all handed to the engine thread at once (one after the other, each
    would wait out an engine step); if one is refused, the others are aborted. `reserved`: the first prompt's
    --max-queue slot is already taken (prepare_off_loop); the others take their own."""
    salt = tenant_cache_salt(ctx.settings, prepared.cache_salt, prepared.key_name)
    owner = owner_of(ctx.settings, prepared.key_name)
    results = await asyncio.gather(*(
        ctx.engine.submit(prepared.engine_request_id(index), prepared.engine_prompt(index), prepared.params,
                          prepared.adapter,
                          prepared.arrival_time, reserved=reserved and index == 0, cache_salt=salt,
                          priority=prepared.priority, tenant=prepared.tenant, owner=owner)
        for index, ids in enumerate(prepared.prompts)), return_exceptions=True)
    errors = [result for result in results if isinstance(result, BaseException)]
    if errors:
        for stream in results:
            if isinstance(stream, RequestStream):
                ctx.engine.abort(stream.request_id)
        exc = next((e for e in errors if isinstance(e, QueueFullError)), errors[0])
        if isinstance(exc, QueueFullError):
            raise ApiError(503, str(exc), "server_overloaded") from None
        if isinstance(exc, ValueError):
            raise ApiError(400, str(exc), "invalid_request") from None
        raise exc
    for ids in prepared.prompts:
        ctx.metrics.count_request(prepared.model, prepared.adapter, len(ids))
        ctx.metrics.count_tenant_request(prepared.tenant or prepared.adapter or "", len(ids), owner)
    return results


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


def usage(prepared: Prepared, *outputs, thinking=None) -> Usage:
    """Over every prompt of the request (an echo-only completion generated nothing); `thinking`: the request's
    ReasoningOutputs (after it split every sequence), which counts the reasoning tokens."""
    num_generated = 0 if prepared.echo_only else sum(len(c.token_ids) for o in outputs for c in o.outputs)
    num_prompt = sum(len(ids) for ids in prepared.prompts)
    cached = PromptTokensDetails(cached_tokens=sum(o.num_cached_tokens for o in outputs))
    details = None
    if thinking is not None:
        details = CompletionTokensDetails(reasoning_tokens=sum(thinking.num_reasoning_tokens(c)
                                                               for o in outputs for c in o.outputs))
    return Usage(prompt_tokens=num_prompt, completion_tokens=num_generated, total_tokens=num_prompt + num_generated,
                 prompt_tokens_details=cached, completion_tokens_details=details)
