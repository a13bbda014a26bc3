"""Stored responses (`store=true`) for `previous_response_id` and `GET`/`DELETE /v1/responses/{id}`.

Bounded, unlike a dict that grows with every request: at most `max_count` records and `max_bytes` of JSON;
the least recently used go first. Each record holds the response as sent and the whole conversation that led
to it, tool calls and their outputs included (chat messages), so a follow-up turn needs no other record (an
evicted ancestor does not break a chain). With `directory` the records are files there (one JSON file each,
written atomically, recency kept in their mtime) and survive a restart; memory then holds only the index.
Each record names its owner (tenancy.py) first, so the index learns it from a file's first bytes.
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


#: The head of a record's file: its owner, written first (a file of an older version has none: owner None).
_OWNER_HEAD = re.compile(rb'^\{"owner":(?:null|"([A-Za-z0-9_.\-]{1,64})")')


class ResponseStore:
    """Records by id, each with its owner (the API key name that made it; None on a server without tenants:
    tenancy.py). A record is found only by its owner: another key's id reads as unknown. Beyond a cap the
    owner holding the most (records, or bytes) loses its least recently used one, so one key's flood evicts
    its own records, not another key's."""

    def __init__(self, max_count: int = 1000, max_bytes: int = 64 << 20, directory: str | None = None):
        if max_count < 0 or max_bytes < 0:
            raise ValueError(f"the response store's caps must be >= 0, got max_count={max_count}, "
                             f"max_bytes={max_bytes}")
        self.max_count, self.max_bytes, self.directory = max_count, max_bytes, directory
        self.owners: dict[str, str | None] = {}  # id -> owner
        self.by_owner: dict[str | None, OrderedDict[str, int]] = {}  # owner -> {id: bytes}, least recent first
        self.owner_bytes: dict[str | None, int] = {}
        self.blobs: dict[str, bytes] = {}  # in memory only (no directory)
        self.num_bytes = 0
        self.lock = threading.Lock()
        if directory is not None:
            os.makedirs(directory, exist_ok=True)
            self._load_index()

    def __len__(self) -> int:
        return len(self.owners)

    def put(self, response_id: str, record: dict, owner: str | None = None) -> bool:
        """Stores `record` (JSON-serializable) as `owner`'s and evicts beyond the caps. False when the one
        record is larger than max_bytes (it is not stored)."""
        assert RESPONSE_ID.match(response_id), response_id
        blob = json.dumps({"owner": owner, **record}, separators=(",", ":")).encode()
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
            self._index(response_id, owner, len(blob))
            self._evict()
        return True

    def get(self, response_id: str, owner: str | None = None) -> dict | None:
        """`owner`'s record, or None when unknown, evicted or another owner's; a hit becomes the most recently
        used."""
        with self.lock:
            if response_id not in self.owners or self.owners[response_id] != owner:
                return None
            self.by_owner[owner].move_to_end(response_id)
            if self.directory is None:
                record = json.loads(self.blobs[response_id])
            else:
                path = self._path(response_id)
                os.utime(path)  # recency survives a restart
                with open(path, "rb") as f:
                    record = json.loads(f.read())
        return record if record.pop("owner", None) == owner else None

    def delete(self, response_id: str, owner: str | None = None) -> bool:
        """Removes `owner`'s record; False (nothing removed) when unknown or another owner's."""
        with self.lock:
            if response_id not in self.owners or self.owners[response_id] != owner:
                return False
            return self._remove(response_id)

    def _index(self, response_id: str, owner: str | None, size: int) -> None:
        self.owners[response_id] = owner
        self.by_owner.setdefault(owner, OrderedDict())[response_id] = size
        self.owner_bytes[owner] = self.owner_bytes.get(owner, 0) + size
        self.num_bytes += size

    def _evict(self) -> None:
        """Beyond a cap: the least recently used record of the owner with the most records (count cap) or the
        most bytes (byte cap)."""
        while len(self.owners) > self.max_count or self.num_bytes > self.max_bytes:
            if len(self.owners) > self.max_count:
                owner = max(self.by_owner, key=lambda o: len(self.by_owner[o]))
            else:
                owner = max(self.owner_bytes, key=self.owner_bytes.__getitem__)
            self._remove(next(iter(self.by_owner[owner])))

    def _remove(self, response_id: str) -> bool:
        if response_id not in self.owners:
            return False
        owner = self.owners.pop(response_id)
        size = self.by_owner[owner].pop(response_id)
        if not self.by_owner[owner]:
            del self.by_owner[owner], self.owner_bytes[owner]
        else:
            self.owner_bytes[owner] -= size
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
        """The records a previous run left, oldest use first, with their owners (read from each file's head);
        then trimmed to this run's caps."""
        found = []
        for entry in os.scandir(self.directory):
            name = entry.name.removesuffix(".json")
            if entry.is_file() and entry.name.endswith(".json") and RESPONSE_ID.match(name):
                stat = entry.stat()
                found.append((stat.st_mtime_ns, name, stat.st_size))
        for _, name, size in sorted(found):
            self._index(name, self._owner_on_disk(name), size)
        self._evict()
        logger.info(f"response store {self.directory}: {len(self.owners)} responses, {self.num_bytes} bytes")

    def _owner_on_disk(self, response_id: str) -> str | None:
        with open(self._path(response_id), "rb") as f:
            head = _OWNER_HEAD.match(f.read(128))
        return head.group(1).decode() if head is not None and head.group(1) is not None else None
