"""What the router knows about a request: its prompt's block hashes (as the prefix cache hashes them) and its
adapter. Computed by the ingress, carried to the router as the `routing` keyword of the replica call.

Kept free of Ray so that it can be tested (and reused) on its own.
"""

from __future__ import annotations

import json
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from paged_hf.core.kv_cache_manager import hash_block

#: at most this many leading blocks of a prompt are hashed: enough to tell shared system prompts apart
MAX_ROUTING_BLOCKS = 64


@dataclass
class RoutingHint:
    """`block_hashes`: chained hashes of the prompt's first full blocks; `adapter`: the LoRA adapter asked for
    (None: the base model); `replica`: send to this replica (fan-out of /metrics, /v1/models, unloads)."""

    block_hashes: list[bytes] = field(default_factory=list)
    adapter: str | None = None
    replica: str | None = None


def prompt_block_hashes(token_ids: list[int], block_size: int, adapter: str | None = None,
                        cache_salt: str | None = None, max_blocks: int = MAX_ROUTING_BLOCKS) -> list[bytes]:
    """The chained hashes of the prompt's full blocks (at most `max_blocks`), keyed like the prefix cache's:
    requests with other adapters or salts never share blocks, so they never share a route either."""
    parts = [] if adapter is None else [b"adapter:" + adapter.encode()]
    if cache_salt is not None:
        parts.append(b"salt:" + cache_salt.encode())
    extra = b"".join(len(part).to_bytes(4, "little") + part for part in parts)
    hashes: list[bytes] = []
    for start in range(0, min(len(token_ids) // block_size, max_blocks) * block_size, block_size):
        hashes.append(hash_block(hashes[-1] if hashes else None, token_ids[start:start + block_size], extra))
    return hashes


def routing_hint(path: str, body: bytes, tokenizer, served_names: set[str], block_size: int,
                 chat_template: str | None = None, tool_call_parser: str = "hermes",
                 trust_request_chat_template: bool = False) -> RoutingHint:
    """The routing hint of an OpenAI request: its prompt read and tokenized exactly as the replica's server
    will (serving.engine_prompt_ids: chat template, tools, template kwargs, truncation), and the adapter its
    `model` names. An empty hint for anything that cannot be read here: the replica answers it as it would. A
    request's own chat template is rendered only where the replicas trust them (--trust-request-chat-template),
    within the replicas' render time limit."""
    # optional dependency: the serving.openai package needs fastapi; the hashing above does not (tested without it)
    from paged_hf.serving.openai.chat_template import TemplatePolicy  # noqa: PLC0415
    from paged_hf.serving.openai.protocol import ChatCompletionRequest, CompletionRequest  # noqa: PLC0415
    from paged_hf.serving.openai.serving import engine_prompt_ids  # noqa: PLC0415

    try:
        chat = path.endswith("/chat/completions")
        request = (ChatCompletionRequest if chat else CompletionRequest).model_validate(json.loads(body or b"{}"))
        # the context length is the replica's to check: a prompt past it is refused whatever its route
        _, ids = engine_prompt_ids(request, tokenizer, chat, 1 << 62, chat_template, tool_call_parser,
                                   policy=TemplatePolicy(trust_request_chat_template=trust_request_chat_template))
    except Exception:  # noqa: BLE001 - bad input is the replica's to answer, with its own error
        return RoutingHint()
    adapter = request.model if isinstance(request.model, str) and request.model not in served_names else None
    return RoutingHint(prompt_block_hashes(ids[0], block_size, adapter, request.cache_salt), adapter)


class PrefixOwners:
    """Which replica was last sent each block hash (an LRU map of at most `capacity` hashes). A replica
    that computed a prefix holds it in its prefix cache until evicted there: route the next request with the
    same prefix to it. `num_roots(replica)`: how many distinct first blocks it owns (new prefixes go to the
    replica with the fewest, so that the prefixes, and the cache they need, spread evenly)."""

    def __init__(self, capacity: int = 1 << 16):
        self.capacity = capacity
        self._owners: OrderedDict[bytes, str] = OrderedDict()
        self._roots: set[bytes] = set()
        self._num_roots: Counter[str] = Counter()

    def longest_match(self, block_hashes: list[bytes], allowed: set[str]) -> tuple[str | None, int]:
        """(the replica holding the longest prefix among `allowed`, its length in blocks), or (None, 0)."""
        for i in range(len(block_hashes) - 1, -1, -1):
            owner = self._owners.get(block_hashes[i])
            if owner is not None and owner in allowed:
                return owner, i + 1
        return None, 0

    def num_roots(self, replica: str) -> int:
        return self._num_roots[replica]

    def record(self, block_hashes: list[bytes], replica: str) -> None:
        if block_hashes:
            root = block_hashes[0]
            if root in self._roots:
                self._num_roots[self._owners[root]] -= 1
            self._roots.add(root)
            self._num_roots[replica] += 1
        for block_hash in block_hashes:
            self._owners[block_hash] = replica
            self._owners.move_to_end(block_hash)
        while len(self._owners) > self.capacity:
            self._drop(next(iter(self._owners)))

    def forget(self, replica: str) -> None:
        """A replica is gone: its prefixes are nowhere."""
        for block_hash in [h for h, owner in self._owners.items() if owner == replica]:
            self._drop(block_hash)

    def _drop(self, block_hash: bytes) -> None:
        owner = self._owners.pop(block_hash)
        if block_hash in self._roots:
            self._roots.discard(block_hash)
            self._num_roots[owner] -= 1
