"""vLLM's routes beside the OpenAI ones: /tokenize, /detokenize, /version, /ping, and runtime LoRA loading.

`/v1/load_lora_adapter` and `/v1/unload_lora_adapter` exist only when the server was started with a LoRA
root (`--lora-root DIR`, the engine's `lora_root`), and load only folders inside it: a path that leaves the root
(`..`, an absolute path elsewhere, a symlink out) is a 400. vLLM had a path-traversal hole here; the generator
itself would read any folder the server process can. Loading runs on the engine thread between two steps.
On a server with named API keys, an adapter a key loads belongs to that key (tenancy.py).
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, Field

import paged_hf
from paged_hf.integrations.peft import folder_inside
from paged_hf.serving.openai.chat_template import chat_prompt_ids
from paged_hf.serving.openai.errors import ApiError
from paged_hf.serving.openai.protocol import ChatMessage, OpenAIRequest
from paged_hf.serving.openai.request_body import read_body
from paged_hf.serving.openai.serving import ServerContext, prompt_ids, request_key_name, until_disconnected
from paged_hf.serving.openai.tenancy import ADAPTER_OWNER_MARK, owner_of
from paged_hf.serving.openai.tool_calls import ChatTool, tool_mode


class TokenizeRequest(OpenAIRequest):
    """vLLM's two forms: `prompt` (a completion) or `messages` (through the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: True for a prompt, False for messages (as vLLM)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None  # vLLM's: rendered as a chat request's are (the prompt's true length)
    return_token_strs: bool = False


class DetokenizeRequest(OpenAIRequest):
    model: str | None = None
    tokens: list[int]


class LoadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False  # vLLM: replace an adapter already loaded under that name


class UnloadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's; names are enough here


def add_extra_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        return PlainTextResponse("")

    @app.get("/version")
    async def version():
        return {"version": paged_hf.__version__}

    @app.post("/tokenize")
    async def tokenize(http_request: Request):
        body = await read_body(http_request, TokenizeRequest, ctx.settings, ("messages",))
        cancel, owner = threading.Event(), owner_of(ctx.settings, request_key_name(http_request))
        return await until_disconnected(asyncio.to_thread(_tokenize, ctx, body, cancel, owner), http_request, cancel)

    @app.post("/detokenize")
    async def detokenize(http_request: Request):
        limit = ctx.settings.max_detokenize_tokens
        body = await read_body(http_request, DetokenizeRequest, ctx.settings, (), then=lambda b: _bounded(b, limit),
                               before=lambda shape: _few_enough(shape.commas, limit))
        owner = owner_of(ctx.settings, request_key_name(http_request))
        return await until_disconnected(asyncio.to_thread(_detokenize, ctx, body, owner), http_request,
                                        threading.Event())

    if ctx.engine.limits.lora_root is not None:
        _add_lora_routes(app, ctx)


def _tokenizer(ctx: ServerContext):
    if ctx.tokenizer is None:
        raise ApiError(400, "this server has no tokenizer", "no_tokenizer")
    return ctx.tokenizer


def _few_enough(num_commas: int, limit: int) -> None:
    """Before parsing: {"model": .., "tokens": [n ids]} has n - 1 or n commas, so more than `limit` of them is
    more than `limit` ids (refused without the 0.1 s a million ids take to parse)."""
    if num_commas > limit:
        raise ApiError(400, f"tokens has more than {limit} ids; at most {limit} are accepted "
                       "(--max-detokenize-tokens)", "too_many_tokens", "tokens")


def _bounded(body: DetokenizeRequest, limit: int) -> DetokenizeRequest:
    if len(body.tokens) > limit:
        raise ApiError(400, f"tokens has {len(body.tokens)} ids; at most {limit} are accepted "
                       "(--max-detokenize-tokens)", "too_many_tokens", "tokens")
    return body


def _detokenize(ctx: ServerContext, body: DetokenizeRequest, owner: str | None = None) -> Response:
    ctx.resolve_model(body.model, owner)
    tokenizer = _tokenizer(ctx)
    vocab_size = ctx.engine.limits.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab_size]
    if bad:
        raise ApiError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})", "invalid_tokens",
                       "tokens")
    return Response(json.dumps({"prompt": decoded(tokenizer, body.tokens)}), media_type="application/json")


def decoded(tokenizer, ids: list[int]) -> str:
    """`tokenizer.decode(ids)`, through the Rust tokenizer's `decode_batch` where that is the same thing: it
    lets the GIL go (a 131k-id `decode` held it 75 ms, every stream waiting)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return tokenizer.decode(ids)
    return backend.decode_batch([ids], skip_special_tokens=False)[0]


def _tokenize(ctx: ServerContext, body: TokenizeRequest, cancel: threading.Event, owner: str | None = None
              ) -> Response:
    """In a worker thread (a 4 MB prompt takes seconds to tokenize; a chat template is a program), the answer
    serialized there too."""
    ctx.resolve_model(body.model, owner)
    tokenizer = _tokenizer(ctx)
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "give exactly one of prompt or messages", "invalid_request", "prompt")
    if body.messages is not None:
        if not body.messages:
            raise ApiError(400, "messages is empty", "invalid_request", "messages")
        ids = chat_prompt_ids(body, tokenizer, tool_mode(body), ctx.settings.tool_call_parser,
                              ctx.settings.chat_template, ctx.template_policy, cancel)
    else:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = prompt_ids(body.prompt, tokenizer, add_special)
    result = {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids}
    if body.return_token_strs:
        result["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
    return Response(json.dumps(result), media_type="application/json")


def resolve_lora_path(root: str, path: str) -> str:
    """The adapter folder `path` (relative to `root`, or absolute) if it lies inside `root` once every `..` and
    symlink is resolved; else ValueError."""
    target = folder_inside(root, path)
    if target is None:
        raise ValueError(f"lora_path {path!r} is not a folder inside the server's LoRA root")
    return target


def _add_lora_routes(app: FastAPI, ctx: ServerContext) -> None:
    """With tenants (tenancy.py) an adapter a key loads is that key's: held under an engine name of its own,
    used, listed and unloaded by that key only; the command line's adapters are nobody's to unload."""
    owners = ctx.adapter_owners

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRARequest, http_request: Request):
        owner = owner_of(ctx.settings, request_key_name(http_request))
        if body.lora_name in (ctx.model_name, *ctx.served_names):
            raise ApiError(400, f"{body.lora_name!r} is the base model's name", "invalid_lora_name", "lora_name")
        if owner is not None and ADAPTER_OWNER_MARK in body.lora_name:
            raise ApiError(400, f"lora_name {body.lora_name!r}: {ADAPTER_OWNER_MARK!r} is reserved on a server with "
                           "named API keys", "invalid_lora_name", "lora_name")
        name = body.lora_name if owner is None else owners.engine_name(body.lora_name, owner)
        if name in ctx.engine.adapter_names and not body.load_inplace:
            raise ApiError(400, f"The lora adapter {body.lora_name!r} has already been loaded (load_inplace=true "
                           "replaces it)", "lora_already_loaded", "lora_name")
        known = name in owners.owned
        if owner is not None:
            owners.add(body.lora_name, owner)  # before the engine has it: no moment where it is nobody's
        try:
            path = resolve_lora_path(ctx.engine.limits.lora_root, body.lora_path)
            await ctx.engine.call(lambda generator: generator.load_adapter(name, path))
        except ValueError as exc:
            if not known:
                owners.remove(name)
            raise ApiError(400, str(exc), "invalid_lora", "lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRARequest, http_request: Request):
        owner = owner_of(ctx.settings, request_key_name(http_request))
        name = body.lora_name if owner is None else owners.engine_name(body.lora_name, owner)
        if name not in ctx.engine.adapter_names or (owner is not None and name not in owners.owned):
            raise ApiError(404, f"The lora adapter {body.lora_name!r} cannot be found", "lora_not_found", "lora_name")
        try:
            await ctx.engine.call(lambda generator: generator.unload_adapter(name))
        except ValueError:  # unloaded meanwhile (the engine's message would list every key's adapters)
            raise ApiError(404, f"The lora adapter {body.lora_name!r} cannot be found", "lora_not_found",
                           "lora_name") from None
        owners.remove(name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
