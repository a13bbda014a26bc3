"""`POST /v1/embeddings` (OpenAI's API): one engine request per input, prefill only, in the same steps as
the generation requests (engine/embedding.py); pooled as the model folder's sentence-transformers config says.

Fields: `input` (a string, a list of strings, a list of token ids or a list of such lists), `model` (the
base model or a LoRA adapter), `encoding_format` (`float`, or `base64`: little-endian float32 bytes, what the
`openai` SDK asks for by default), `dimensions` (Matryoshka truncation, normalized after it), `user` (the
request's tenant, as on the other routes).

A batch of up to `--max-embedding-inputs` inputs is one answer, computed in engine-sized pieces: at most two
of the engine's batches (`max_num_seqs`) of its inputs are queued at once, the next input as soon as one
finishes, so a big batch neither waits one engine step per input nor floods the queue ahead of others'
requests. Tokenizing and writing the answer (megabytes of JSON) run in a worker thread, paced.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from dataclasses import replace
from typing import Literal

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import Field

from paged_hf.pooling_params import PoolingParams
from paged_hf.serving.openai.completions import last_output
from paged_hf.serving.openai.engine_loop import EngineError
from paged_hf.serving.openai.errors import ApiError
from paged_hf.serving.openai.gil_pacing import Pacer
from paged_hf.serving.openai.protocol import OpenAIRequest
from paged_hf.serving.openai.request_body import read_body
from paged_hf.serving.openai.serving import Prepared, ServerContext, outputs, prompt_ids, request_key_name, submit
from paged_hf.serving.openai.tenancy import owner_of

#: Engine batches of one request's inputs in the engine at once.
PIECES_IN_FLIGHT = 2


class EmbeddingRequest(OpenAIRequest):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None  # OpenAI: who asked; never changes the answer (the tenant, as on the other routes)


def add_embeddings_route(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(http_request: Request):
        body = await read_body(http_request, EmbeddingRequest, ctx.settings, ())
        return await _embed(ctx, body, http_request)


def _inputs(body: EmbeddingRequest, max_inputs: int) -> list[str | list[int]]:
    value = body.input
    inputs = [value] if isinstance(value, str) or (value and isinstance(value[0], int)) else list(value)
    if not inputs or any(len(item) == 0 for item in inputs):
        raise ApiError(400, "input must not be empty (nor any of its items)", "invalid_input", "input")
    if len(inputs) > max_inputs:
        raise ApiError(400, f"input has {len(inputs)} items; at most {max_inputs} are accepted "
                       "(--max-embedding-inputs)", "invalid_input", "input")
    return inputs


def _tokenized(inputs: list, tokenizer, max_model_len: int, busy=None) -> list[list[int]]:
    """Every input's ids, each checked against the context before any is computed (paced while `busy()`)."""
    ids, pacer = [], Pacer(busy)
    for i, item in enumerate(inputs):
        ids.append(prompt_ids(item, tokenizer, True))
        pacer.tick()
        if len(ids[-1]) > max_model_len:
            raise ApiError(400, f"input[{i}] has {len(ids[-1])} tokens; at most max_model_len={max_model_len} (the "
                           "model's context) are accepted", "context_length_exceeded", "input")
    return ids


async def _embed(ctx: ServerContext, body: EmbeddingRequest, http_request: Request) -> Response:
    key_name = request_key_name(http_request)
    adapter = ctx.resolve_model(body.model, owner_of(ctx.settings, key_name))
    inputs = _inputs(body, ctx.settings.max_embedding_inputs)
    busy = (lambda: ctx.engine.num_in_flight > 0)  # other requests in the engine: pace this request's Python work
    ids = await asyncio.to_thread(_tokenized, inputs, ctx.tokenizer, ctx.max_model_len, busy)
    prepared = Prepared(f"embd-{uuid.uuid4().hex}", body.model or ctx.model_name, adapter, ids,
                        PoolingParams(dimensions=body.dimensions), stream=False, include_usage=False, chat=False,
                        arrival_time=time.monotonic(), tenant=body.user or key_name, key_name=key_name)
    finals = await _in_pieces(ctx, prepared, http_request)
    return await asyncio.to_thread(_answer, prepared, finals, body.encoding_format, busy)


async def _in_pieces(ctx: ServerContext, prepared: Prepared, http_request: Request) -> list:
    """Each input's final output, in input order; at most PIECES_IN_FLIGHT engine batches queued at once. The
    first failure (a bad input: 400) cancels the rest, and their engine requests are aborted."""
    piece = ctx.engine.limits.max_num_seqs
    gate = asyncio.Semaphore(PIECES_IN_FLIGHT * piece)

    async def one(index: int):
        async with gate:
            single = replace(prepared, request_id=prepared.engine_request_id(index), prompts=[prepared.prompts[index]])
            stream, = await submit(ctx, single)  # a bad input (dimensions too large) is a 400 here
            return await last_output(outputs(ctx, http_request, stream, False))

    tasks = [asyncio.ensure_future(one(i)) for i in range(len(prepared.prompts))]
    try:
        finals = await asyncio.gather(*tasks)
    except EngineError as exc:
        raise ApiError(500, str(exc), "engine_error") from None
    finally:
        for task in tasks:
            task.cancel()
    if any(final is None or final.outputs is None for final in finals):  # the client went away, or aborted
        raise ApiError(499, "client disconnected", "client_disconnected")
    return finals


def _answer(prepared: Prepared, finals: list, encoding_format: str, busy=None) -> Response:
    """The answer's JSON, written one embedding at a time and paced while `busy()` (gil_pacing.py): 2,048 of them
    are megabytes of floats, which in one `json.dumps` held the GIL for a quarter of a second."""
    pacer, items = Pacer(busy), []
    for i, final in enumerate(finals):
        items.append(f'{{"object":"embedding","index":{i},"embedding":'
                     f'{json.dumps(_encoded(final.outputs.embedding, encoding_format))}}}')
        pacer.tick()
    num_tokens = sum(len(p) for p in prepared.prompts)
    tail = json.dumps({"model": prepared.model, "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})
    return Response(f'{{"object":"list","data":[{",".join(items)}],{tail[1:]}', media_type="application/json")


def _encoded(embedding: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return embedding
    return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")  # float32 LE
