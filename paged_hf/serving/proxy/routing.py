"""Which upstream answers a request: straight to a decode instance, or a prefill instance first.

Free of HTTP (the token count comes in as a callable), so the rules can be read and tested on their own:
a batch of prompts, a prompt already transferred and a short prompt go straight to decode; any other goes
through a prefill instance, whose KV blocks the decode instance then reads instead of computing them again.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

#: request fields that decide the prompt the engine sees (and so which KV blocks it has)
PROMPT_FIELDS = ("prompt", "messages", "tools", "chat_template", "chat_template_kwargs", "add_generation_prompt",
                 "continue_final_message", "add_special_tokens", "truncate_prompt_tokens", "cache_salt")
#: chat fields /tokenize understands beside `messages` (a prompt renders there as it will for decode)
TOKENIZE_CHAT_FIELDS = ("add_generation_prompt", "continue_final_message", "add_special_tokens", "chat_template",
                        "chat_template_kwargs", "tools")
#: fields that cannot hold with max_tokens = 1 and n = 1 (the prefill's answer is thrown away anyway)
PREFILL_DROPPED = ("stream_options", "min_tokens", "best_of")


@dataclass(frozen=True)
class ProxySettings:
    """`prefill_urls`, `decode_urls`: the instances' base URLs (http://host:port). A prompt of fewer than
    `prefill_threshold_tokens` tokens goes straight to decode. `on_prefill_failure`: "recompute" (decode
    computes the prompt itself) or "fail" (503). `api_key`: what clients of the proxy must send, if set.
    `max_body_bytes`: larger request bodies get a 413 (the proxy reads a body whole to route it)."""

    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    prefill_threshold_tokens: int = 256
    on_prefill_failure: str = "recompute"
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    max_remembered_prompts: int = 10_000
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 600.0

    def __post_init__(self):
        for name in ("prefill_urls", "decode_urls"):
            urls = tuple(url.rstrip("/") for url in getattr(self, name))
            if not (urls or name == "prefill_urls") or not all(url.startswith(("http://", "https://")) for url in urls):
                raise ValueError(f"{name} must be http:// or https:// URLs (decode_urls: one or more), got {list(urls)}")
            object.__setattr__(self, name, urls)
        if self.prefill_threshold_tokens < 0:
            raise ValueError(f"prefill_threshold_tokens must be >= 0, got {self.prefill_threshold_tokens}")
        if self.on_prefill_failure not in ("recompute", "fail"):
            raise ValueError(f"on_prefill_failure must be recompute or fail, got {self.on_prefill_failure!r}")


@dataclass(frozen=True)
class Plan:
    """Where one request goes: `prefill_url` None means straight to `decode_url`. `key` names its prompt for
    the memory of transferred prompts (None: a batch, never remembered)."""

    decode_url: str
    prefill_url: str | None
    key: str | None

    @property
    def path(self) -> str:
        return "direct" if self.prefill_url is None else "disaggregated"


class RoundRobin:
    def __init__(self, urls: tuple[str, ...]):
        self.urls, self._next = urls, 0

    def pick(self) -> str:
        url = self.urls[self._next % len(self.urls)]
        self._next += 1
        return url


class TransferredPrompts:
    """An LRU of prompt keys -> the decode instance that holds their blocks, so a repeat goes there directly."""

    def __init__(self, capacity: int):
        self.capacity, self._urls = capacity, OrderedDict()

    def get(self, key: str) -> str | None:
        url = self._urls.get(key)
        if url is not None:
            self._urls.move_to_end(key)
        return url

    def remember(self, key: str, url: str) -> None:
        self._urls[key] = url
        self._urls.move_to_end(key)
        while len(self._urls) > self.capacity:
            self._urls.popitem(last=False)


def prompt_key(route: str, body: dict, authorization: str | None) -> str:
    """A hash of what decides the request's KV blocks, and of its key: another key's salt-free prompt may be
    cached apart (prefix-cache isolation), so it is remembered apart too."""
    parts = [route, body.get("model"), {name: body.get(name) for name in PROMPT_FIELDS}, authorization]
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def single_prompt(body: dict) -> str | list | None:
    """A completion's one prompt (a string or token ids; a one-element batch unwrapped), or None for a batch
    of several: a batch goes straight to decode, since the prefill answers one request with one transfer."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return prompt[0] if len(prompt) == 1 else None
    return prompt


def tokenize_body(body: dict, chat: bool) -> dict:
    """vLLM's /tokenize request for the prompt of `body` (a completion's string prompt, or a chat)."""
    if not chat:
        extra = {"add_special_tokens": body["add_special_tokens"]} if "add_special_tokens" in body else {}
        return {"model": body.get("model"), "prompt": single_prompt(body), **extra}
    return {"model": body.get("model"), "messages": body.get("messages"),
            **{name: body[name] for name in TOKENIZE_CHAT_FIELDS if name in body}}


def prefill_body(body: dict, chat: bool) -> dict:
    """The request a prefill instance gets: one token, not streamed, and asked to keep its blocks for decode."""
    result = {name: value for name, value in body.items() if name not in PREFILL_DROPPED}
    result.update(max_tokens=1, stream=False, n=1, kv_transfer_params={"do_remote_decode": True})
    if chat and "max_completion_tokens" in body:
        result["max_completion_tokens"] = 1
    return result


class Router:
    """Round robin over each kind of instance, the short-prompt threshold and the memory of transfers."""

    def __init__(self, settings: ProxySettings):
        self.settings = settings
        self.prefills, self.decodes = RoundRobin(settings.prefill_urls), RoundRobin(settings.decode_urls)
        self.transferred = TransferredPrompts(settings.max_remembered_prompts)

    async def plan(self, route: str, body: dict, authorization: str | None,
                   count_tokens: Callable[[str, dict], Awaitable[int | None]]) -> Plan:
        """`count_tokens(decode_url, tokenize_body)`: the prompt's tokens by that instance's /tokenize, None
        when it could not say (then the prompt counts as long)."""
        chat = route.endswith("/chat/completions")
        prompt = None if chat else single_prompt(body)
        if not self.settings.prefill_urls or not chat and prompt is None:  # no prefill instance: a load balancer
            return Plan(self.decodes.pick(), None, None)
        key = prompt_key(route, body, authorization)
        known = self.transferred.get(key)
        if known is not None:
            return Plan(known, None, key)
        decode_url = self.decodes.pick()
        if isinstance(prompt, list):  # token ids: counted here
            num_tokens = len(prompt)
        else:
            num_tokens = await count_tokens(decode_url, tokenize_body(body, chat))
        if num_tokens is not None and num_tokens < self.settings.prefill_threshold_tokens:
            return Plan(decode_url, None, key)
        return Plan(decode_url, self.prefills.pick(), key)

    def remember(self, plan: Plan) -> None:
        """After the decode instance answered a prompt: its blocks are there now."""
        if plan.key is not None:
            self.transferred.remember(plan.key, plan.decode_url)
