"""Stored responses (`store=true`) for `previous_response_id` and `GET`/`DELETE /v1/responses/{id}`.

Bounded, unlike a dict that grows with every request: at most `max_count` records and `max_bytes` of JSON;
the least recently used go first. Each record holds the response as sent and the whole conversation that led
to it, tool calls and their outputs included (chat messages), so a follow-up turn needs no other record (an
evicted ancestor does not break a chain). With `directory` the records are files there (one JSON file each,
written atomically, recency kept in their mtime) and survive a restart; memory then holds only the index.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections import OrderedDict

from transformers.utils import logging

logger = logging.get_logger(__name__)

#: The ids this server gives out; anything else is unknown (and never becomes a file name).
RESPONSE_ID = re.compile(r"^resp_[0-9a-f]{32}$")


class ResponseStore:
    def __init__(self, max_count: int = 1000, max_bytes: int = 64 << 20, directory: str | None = None):
        if max_count < 0 or max_bytes < 0:
            raise ValueError(f"the response store's caps must be >= 0, got max_count={max_count}, "
                             f"max_bytes={max_bytes}")
        self.max_count, self.max_bytes, self.directory = max_count, max_bytes, directory
        self.sizes: OrderedDict[str, int] = OrderedDict()  # id -> bytes, least recently used first
        self.blobs: dict[str, bytes] = {}  # in memory only (no directory)
        self.num_bytes = 0
        self.lock = threading.Lock()
        if directory is not None:
            os.makedirs(directory, exist_ok=True)
            self._load_index()

    def __len__(self) -> int:
        return len(self.sizes)

    def put(self, response_id: str, record: dict) -> bool:
        """Stores `record` (JSON-serializable) and evicts the least recently used beyond the caps. False when
        the one record is larger than max_bytes (it is not stored)."""
        assert RESPONSE_ID.match(response_id), response_id
        blob = json.dumps(record, separators=(",", ":")).encode()
        if len(blob) > self.max_bytes or self.max_count == 0:
            logger.warning(f"response {response_id} ({len(blob)} bytes) is not stored: over --responses-store-max-*")
            return False
        with self.lock:
            self._remove(response_id)
            if self.directory is None:
                self.blobs[response_id] = blob
            else:
                temporary = self._path(response_id) + ".tmp"
                with open(temporary, "wb") as f:
                    f.write(blob)
                os.replace(temporary, self._path(response_id))
            self.sizes[response_id] = len(blob)
            self.num_bytes += len(blob)
            while len(self.sizes) > self.max_count or self.num_bytes > self.max_bytes:
                self._remove(next(iter(self.sizes)))
        return True

    def get(self, response_id: str) -> dict | None:
        """The record, or None when unknown or evicted; a hit becomes the most recently used."""
        with self.lock:
            if response_id not in self.sizes:
                return None
            self.sizes.move_to_end(response_id)
            if self.directory is None:
                return json.loads(self.blobs[response_id])
            path = self._path(response_id)
            os.utime(path)  # recency survives a restart
            with open(path, "rb") as f:
                return json.loads(f.read())

    def delete(self, response_id: str) -> bool:
        with self.lock:
            return self._remove(response_id)

    def _remove(self, response_id: str) -> bool:
        size = self.sizes.pop(response_id, None)
        if size is None:
            return False
        self.num_bytes -= size
        self.blobs.pop(response_id, None)
        if self.directory is not None:
            try:
                os.remove(self._path(response_id))
            except FileNotFoundError:
                pass
        return True

    def _path(self, response_id: str) -> str:
        return os.path.join(self.directory, response_id + ".json")

    def _load_index(self) -> None:
        """The records a previous run left, oldest use first; then trimmed to this run's caps."""
        found = []
        for entry in os.scandir(self.directory):
            name = entry.name.removesuffix(".json")
            if entry.is_file() and entry.name.endswith(".json") and RESPONSE_ID.match(name):
                stat = entry.stat()
                found.append((stat.st_mtime_ns, name, stat.st_size))
        for _, name, size in sorted(found):
            self.sizes[name] = size
            self.num_bytes += size
        while len(self.sizes) > self.max_count or self.num_bytes > self.max_bytes:
            self._remove(next(iter(self.sizes)))
        logger.info(f"response store {self.directory}: {len(self.sizes)} responses, {self.num_bytes} bytes")
