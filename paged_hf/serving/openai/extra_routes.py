"""vLLM's routes beside the OpenAI ones: /tokenize, /detokenize, /version, /ping, and runtime LoRA loading.

`/v1/load_lora_adapter` and `/v1/unload_lora_adapter` exist only when the server was started with a LoRA
root (`--lora-root DIR`, ServerSettings.lora_root), and load only folders inside it: a path that leaves the root
(`..`, an absolute path elsewhere, a symlink out) is a 400. vLLM had a path-traversal hole here; the generator
itself would read any folder the server process can. Loading runs on the engine thread between two steps.
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
from paged_hf.serving.openai.serving import ServerContext, prompt_ids, until_disconnected


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
    async def tokenize(body: TokenizeRequest, http_request: Request):
        cancel = threading.Event()
        return await until_disconnected(asyncio.to_thread(_tokenize, ctx, body, cancel), http_request, cancel)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, http_request: Request):
        return await until_disconnected(asyncio.to_thread(_detokenize, ctx, body), http_request, threading.Event())

    if ctx.settings.lora_root is not None:
        _add_lora_routes(app, ctx)


def _tokenizer(ctx: ServerContext):
    if ctx.tokenizer is None:
        raise ApiError(400, "this server has no tokenizer", "no_tokenizer")
    return ctx.tokenizer


def _detokenize(ctx: ServerContext, body: DetokenizeRequest) -> Response:
    ctx.resolve_model(body.model)
    tokenizer = _tokenizer(ctx)
    vocab_size = ctx.engine.generator.info.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab_size]
    if bad:
        raise ApiError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})", "invalid_tokens",
                       "tokens")
    return Response(json.dumps({"prompt": tokenizer.decode(body.tokens)}), media_type="application/json")


def _tokenize(ctx: ServerContext, body: TokenizeRequest, cancel: threading.Event) -> Response:
    """In a worker thread (a 4 MB prompt takes seconds to tokenize; a chat template is a program), the answer
    serialized there too."""
    ctx.resolve_model(body.model)
    tokenizer = _tokenizer(ctx)
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "give exactly one of prompt or messages", "invalid_request", "prompt")
    if body.messages is not None:
        if not body.messages:
            raise ApiError(400, "messages is empty", "invalid_request", "messages")
        ids = chat_prompt_ids(body, tokenizer, chat_template=ctx.settings.chat_template, policy=ctx.template_policy,
                              cancel=cancel)
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
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRARequest):
        if body.lora_name in (ctx.model_name, *ctx.served_names):
            raise ApiError(400, f"{body.lora_name!r} is the base model's name", "invalid_lora_name", "lora_name")
        if body.lora_name in ctx.engine.adapter_names and not body.load_inplace:
            raise ApiError(400, f"The lora adapter {body.lora_name!r} has already been loaded (load_inplace=true "
                           "replaces it)", "lora_already_loaded", "lora_name")
        try:
            path = resolve_lora_path(ctx.settings.lora_root, body.lora_path)
            await ctx.engine.call(lambda generator: generator.load_adapter(body.lora_name, path))
        except ValueError as exc:
            raise ApiError(400, str(exc), "invalid_lora", "lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRARequest):
        if body.lora_name not in ctx.engine.adapter_names:
            raise ApiError(404, f"The lora adapter {body.lora_name!r} cannot be found", "lora_not_found", "lora_name")
        try:
            await ctx.engine.call(lambda generator: generator.unload_adapter(body.lora_name))
        except ValueError as exc:
            raise ApiError(404, str(exc), "lora_not_found", "lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
