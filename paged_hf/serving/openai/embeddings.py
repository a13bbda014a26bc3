"""`POST /v1/embeddings` (OpenAI's API): one engine request per input, prefill only, in the same steps as
the generation requests (engine/embedding.py); pooled as the model folder's sentence-transformers config says.

Fields: `input` (a string, a list of strings, a list of token ids or a list of such lists), `model` (the
base model or a LoRA adapter), `encoding_format` (`float`, or `base64`: little-endian float32 bytes, what the
`openai` SDK asks for by default), `dimensions` (Matryoshka truncation, normalized after it), `user` (ignored).
"""

from __future__ import annotations

import asyncio
import base64
import struct
import time
import uuid
from typing import Literal

from fastapi import FastAPI, Request
from pydantic import Field

from paged_hf.pooling_params import PoolingParams
from paged_hf.serving.openai.completions import last_output
from paged_hf.serving.openai.engine_loop import EngineError
from paged_hf.serving.openai.errors import ApiError
from paged_hf.serving.openai.protocol import OpenAIRequest
from paged_hf.serving.openai.serving import Prepared, ServerContext, outputs, prompt_ids, submit

#: inputs of one request at most (OpenAI's limit)
MAX_INPUTS = 2048


class EmbeddingRequest(OpenAIRequest):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None  # OpenAI: who asked (abuse monitoring); never changes the answer


def add_embeddings_route(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, http_request: Request):
        return await _embed(ctx, body, http_request)


def _inputs(body: EmbeddingRequest) -> list[str | list[int]]:
    value = body.input
    inputs = [value] if isinstance(value, str) or (value and isinstance(value[0], int)) else list(value)
    if not inputs or any(len(item) == 0 for item in inputs):
        raise ApiError(400, "input must not be empty (nor any of its items)", "invalid_input", "input")
    if len(inputs) > MAX_INPUTS:
        raise ApiError(400, f"at most {MAX_INPUTS} inputs per request, got {len(inputs)}", "invalid_input", "input")
    return inputs


async def _embed(ctx: ServerContext, body: EmbeddingRequest, http_request: Request) -> dict:
    adapter = ctx.resolve_model(body.model)
    inputs = _inputs(body)
    ids = await asyncio.to_thread(lambda: [prompt_ids(item, ctx.tokenizer, True) for item in inputs])
    prepared = Prepared(f"embd-{uuid.uuid4().hex}", body.model or ctx.model_name, adapter, ids,
                        PoolingParams(dimensions=body.dimensions), stream=False, include_usage=False, chat=False,
                        arrival_time=time.monotonic())
    streams = await submit(ctx, prepared)  # a bad input (too long, dimensions too large) is a 400 here
    try:
        finals = await asyncio.gather(*(last_output(outputs(ctx, http_request, s, False)) for s in streams))
    except EngineError as exc:
        raise ApiError(500, str(exc), "engine_error") from None
    if any(final is None or final.outputs is None for final in finals):  # the client went away, or aborted
        raise ApiError(499, "client disconnected", "client_disconnected")
    data = [{"object": "embedding", "index": i, "embedding": _encoded(final.outputs.embedding, body.encoding_format)}
            for i, final in enumerate(finals)]
    num_tokens = sum(len(p) for p in ids)
    return {"object": "list", "data": data, "model": prepared.model,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}


def _encoded(embedding: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return embedding
    return base64.b64encode(struct.pack(f"<{len(embedding)}f", *embedding)).decode("ascii")  # float32 LE
