"""What one API key may see of another's: nothing, once the server has tenants.

A server with several API keys (or one named key: `--api-key NAME=KEY`) has tenants, one per key name
(api_keys.py). Then what a key makes belongs to its name and another key finds it as if it did not exist (the
same 404 as an unknown name): stored responses (responses_store.py records their owner), adapters loaded at
run time with `/v1/load_lora_adapter` (held under an engine name of their own per key, so two keys may each
load `sql`), their labels and the per-tenant series of `/metrics` (metrics.py: a key sees its own, the keys
named by `--metrics-key` see all). A server with no key, or one plain `--api-key KEY`, has no tenants: its
owner is None, as before.

`--prefix-cache-isolation key` also keeps prefix-cache hits within a key: each request's `cache_salt` is
combined with its key's name, so a block one key computed is never found by another's request. Without it a
prefix-cache hit shows in the time to first token, which tells a key that another one sent the same prefix.
"""

from __future__ import annotations

import json

PREFIX_CACHE_ISOLATION = ("none", "key")

#: Joins an adapter's name and its owner into the engine's name for it (not a key-name character).
ADAPTER_OWNER_MARK = "@"


def owner_of(settings, key_name: str | None) -> str | None:
    """The owner of what a request with this key name makes: its name when the server has tenants, else None."""
    return key_name if settings.tenant_isolation else None


def tenant_cache_salt(settings, cache_salt: str | None, key_name: str | None) -> str | None:
    """The salt the engine gets: with --prefix-cache-isolation key, the request's own (or none) bound to its
    key's name, so equal prompts of two keys never share a cached block."""
    if settings.prefix_cache_isolation != "key":
        return cache_salt
    assert key_name is not None, "--prefix-cache-isolation key is refused without API keys"
    return json.dumps([key_name, cache_salt])


class AdapterOwners:
    """Adapters that keys loaded at run time, under tenants: engine name (`NAME@OWNER`) -> (owner, NAME).
    Adapters of the command line (`--adapter`, `--lora-root`) belong to nobody: every key may use them."""

    def __init__(self):
        self.owned: dict[str, tuple[str, str]] = {}

    @staticmethod
    def engine_name(name: str, owner: str) -> str:
        return f"{name}{ADAPTER_OWNER_MARK}{owner}"

    def add(self, name: str, owner: str) -> str:
        engine_name = self.engine_name(name, owner)
        self.owned[engine_name] = (owner, name)
        return engine_name

    def remove(self, engine_name: str) -> None:
        self.owned.pop(engine_name, None)

    def visible(self, engine_name: str, owner: str | None) -> bool:
        """Whether a key with `owner` may see the engine's adapter `engine_name`."""
        held = self.owned.get(engine_name)
        return held is None or held[0] == owner

    def client_name(self, engine_name: str) -> str:
        """The name the owner uses for it."""
        held = self.owned.get(engine_name)
        return engine_name if held is None else held[1]

    def own(self, name: str, owner: str | None, served: tuple[str, ...]) -> str | None:
        """The engine name of the adapter `owner` loaded as `name`, if it did and it is still served."""
        if owner is None:
            return None
        engine_name = self.engine_name(name, owner)
        return engine_name if engine_name in self.owned and engine_name in served else None
