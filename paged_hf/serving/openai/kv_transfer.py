"""Disaggregated prefill and decode on the server: a KV producer's answer carries `kv_transfer_params`, a KV
consumer brings the blocks they name into its own KV tier before it queues the request (docs/disaggregated.md).

The blocks are the KV tier's files (`worker/kv_tier/block_file.py`), keyed by a hash chain over the model, the
adapter, the cache salt and the tokens. A consumer never trusts the params: it looks the prompt up under the keys
it computes itself, so a block the producer named wrongly is a miss, one of another model (namespace) is not
fetched, and one that is truncated or overwritten fails its checks when read. A miss is recomputed.

Two transports: a directory both instances use (the producer's files are indexed where they lie) and a pull
over HTTP from the producer's `GET /v1/kv_blocks/{key}` (behind its API key), each file checked before it is kept.
The pull runs in a worker thread, so a transfer never stalls the event loop or the engine.
"""

from __future__ import annotations

import asyncio
import os
import re
import threading

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response

from paged_hf.config.kv_transfer import CONNECTOR
from paged_hf.serving.openai.errors import ApiError

KEY_HEX = re.compile(r"[0-9a-f]{32}")
MAX_HEADER_BYTES = 1 << 20  # a block file's safetensors header is a few KB; a larger answer is not one of ours


class KVTransfer:
    """The server's side of one engine's `kv_transfer_config`: answers (producer), receives (consumer), counts."""

    def __init__(self, config, tier):
        """`config`: the engine's KVTransferConfig; `tier`: its KV tier, whose directory holds the block files."""
        self.config = config
        self.tier = tier
        self.disk = self.tier.store.disk
        self.block_size = self.tier.block_size
        self.folder = os.path.realpath(self.disk.folder)
        self.lock = threading.Lock()
        self.counts = {"sent_requests": 0, "received_requests": 0, "received_blocks": 0, "received_bytes": 0,
                       "rejected_blocks": 0, "foreign_requests": 0, "failed_pulls": 0}

    def count(self, **deltas: int) -> None:
        with self.lock:
            for name, delta in deltas.items():
                self.counts[name] += delta

    # --- producer -------------------------------------------------------------------------------------------
    async def answer_params(self, output, http_request: Request) -> dict | None:
        """The finished prompt's `kv_transfer_params`: its leading blocks that are on disk (the writer's queue
        landed first), where to get them, and what they hold."""
        params = output.kv_transfer_params
        if not self.config.is_producer or params is None:
            return None
        await asyncio.to_thread(self.disk.flush, self.config.timeout_s)
        keys, num_bytes = [], 0
        for key in params["block_keys"]:
            size = self.disk.size(bytes.fromhex(key))
            if size is None:
                break  # dropped or evicted: the consumer computes from here on
            keys.append(key)
            num_bytes += size
        self.count(sent_requests=1)
        url = self.config.kv_connector_extra_config.get("url") or str(http_request.base_url).rstrip("/")
        return {"connector": CONNECTOR, "namespace": params["namespace"], "block_keys": keys,
                "num_tokens": len(keys) * self.block_size, "num_bytes": num_bytes, "remote_url": url,
                "kv_dir": self.folder}

    def block_file(self, key_hex: str) -> bytes | None:
        if not self.config.is_producer or not KEY_HEX.fullmatch(key_hex):
            return None
        return self.disk.file_bytes(bytes.fromhex(key_hex))

    # --- consumer -------------------------------------------------------------------------------------------
    async def receive(self, params: dict | None, http_request: Request, max_blocks: int) -> None:
        """Bring the blocks `params` names into this tier (a shared folder: index them; else pull them), in
        prompt order, stopping at the first that is missing or bad. Never fails the request: what is not
        brought is computed."""
        if not self.config.is_consumer or not params or "block_keys" not in params:
            return  # e.g. the proxy's {"do_remote_decode": true} to a producer
        keys, url = checked_params(params, max_blocks)
        if params.get("namespace") != self.tier.namespace.hex():
            self.count(foreign_requests=1)  # another model, dtype or block size: its blocks are not ours
            return
        self.count(received_requests=1)
        if os.path.realpath(str(params.get("kv_dir", ""))) == self.folder:
            await asyncio.to_thread(self._adopt, keys)
        elif url:
            api_key = self.config.kv_connector_extra_config.get("api_key")
            auth = f"Bearer {api_key}" if api_key else http_request.headers.get("authorization")
            await asyncio.to_thread(self._pull, url, keys, auth)

    def _adopt(self, keys: list[bytes]) -> None:
        for key in keys:
            if not self.disk.adopt(key):
                return

    def _pull(self, url: str, keys: list[bytes], auth: str | None) -> None:
        limit = self.disk.layout.nbytes + MAX_HEADER_BYTES
        headers = {"Authorization": auth} if auth else {}
        with httpx.Client(timeout=self.config.timeout_s, headers=headers) as client:
            for key in keys:
                if self.disk.contains(key):
                    continue
                data = fetch(client, f"{url}/v1/kv_blocks/{key.hex()}", limit)
                if data is None:
                    self.count(failed_pulls=1)
                    return
                try:
                    self.disk.receive(key, data)
                except ValueError:  # truncated, overwritten, another model's: recomputed
                    self.count(rejected_blocks=1)
                    return
                self.count(received_blocks=1, received_bytes=len(data))

    def render(self) -> str:
        with self.lock:
            counts = dict(self.counts)
        lines = []
        for name, help_text in HELP.items():
            metric = f"paged_hf_kv_transfer_{name}_total"
            lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} counter", f"{metric} {counts[name]}"]
        return "\n".join(lines) + "\n"


HELP = {"sent_requests": "Answers that carried kv_transfer_params (a producer).",
        "received_requests": "Requests whose kv_transfer_params this consumer used.",
        "received_blocks": "KV blocks pulled over HTTP and kept.",
        "received_bytes": "Bytes of KV block files pulled and kept.",
        "rejected_blocks": "Pulled blocks that failed their checks (recomputed).",
        "foreign_requests": "kv_transfer_params of another model, dtype or block size (ignored, recomputed).",
        "failed_pulls": "Pulls that stopped at a missing block or an unreachable producer (the rest recomputed)."}


def checked_params(params: dict, max_blocks: int) -> tuple[list[bytes], str | None]:
    """(block keys, producer URL) from a consumer's `kv_transfer_params`; a 400 for a malformed one."""
    keys, url = params.get("block_keys"), params.get("remote_url")
    if (not isinstance(keys, list) or len(keys) > max_blocks
            or not all(isinstance(k, str) and KEY_HEX.fullmatch(k) for k in keys)):
        raise ApiError(400, f"kv_transfer_params.block_keys must be a list of at most {max_blocks} block keys "
                       "(32 hex digits each)", "invalid_kv_transfer_params", "kv_transfer_params")
    if url is not None and not (isinstance(url, str) and re.fullmatch(r"https?://[^\s/]+(/[^\s]*)?", url)):
        raise ApiError(400, "kv_transfer_params.remote_url must be an http(s) URL", "invalid_kv_transfer_params",
                       "kv_transfer_params")
    return [bytes.fromhex(k) for k in keys], url.rstrip("/") if url else None


def fetch(client: httpx.Client, url: str, limit: int) -> bytes | None:
    """The body of a 200 of at most `limit` bytes, else None (unreachable, an error, too large)."""
    try:
        with client.stream("GET", url) as response:
            if response.status_code != 200:
                return None
            chunks, size = [], 0
            for chunk in response.iter_bytes():
                size += len(chunk)
                if size > limit:
                    return None
                chunks.append(chunk)
            return b"".join(chunks)
    except httpx.HTTPError:
        return None


def add_kv_transfer_routes(app: FastAPI, ctx) -> None:
    @app.get("/v1/kv_blocks/{key_hex}")
    async def kv_block(key_hex: str):
        data = None if ctx.kv_transfer is None else await asyncio.to_thread(ctx.kv_transfer.block_file, key_hex)
        if data is None:
            raise ApiError(404, "no such KV block", "not_found")
        return Response(data, media_type="application/octet-stream")
