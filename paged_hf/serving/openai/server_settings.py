"""`ServerSettings`: the server's keys, tenancy and limits (`paged-hf serve`'s flags, docs/serving.md).

Every limit on a request's shape is checked before the request is accepted, and one over it is a 400 (a body
over `max_body_bytes`: 413) whose message names the flag.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from paged_hf.serving.openai.api_keys import has_tenants, named_api_keys
from paged_hf.serving.openai.media import MediaLimits
from paged_hf.serving.openai.reasoning import PARSER_NAMES
from paged_hf.serving.openai.tenancy import PREFIX_CACHE_ISOLATION


@dataclass
class ServerSettings:
    """Limits that keep one client from exhausting the server (each over-limit request gets a 4xx/503)."""

    # one key, or several (`KEY` or `NAME=KEY` each: api_keys.py); each key is a tenant, named
    api_key: str | list[str] | None = None
    api_keys: dict[str, str] = field(default_factory=dict)  # more keys by name (--api-key-file)
    prefix_cache_isolation: str = "none"  # "key": prefix-cache hits only within a key (tenancy.py)
    metrics_keys: tuple[str, ...] = ()  # key names whose /metrics shows every tenant (others: their own)
    max_body_bytes: int = 4 << 20  # 413 above
    max_json_depth: int = 1000  # a body nested deeper: 400 (request_body.py)
    max_request_items: int = 2048  # messages, input items, content blocks, tools of one request: 400 above
    max_embedding_inputs: int = 2048  # /v1/embeddings inputs (OpenAI's limit); 400 above
    max_detokenize_tokens: int = 131072  # /detokenize ids; 400 above
    max_n: int = 16  # 400 above
    max_tokens_cap: int | None = 4096  # 400 above; also caps the default max_tokens
    max_queue: int = 8192  # unfinished requests at once; 503 above (vLLM's benchmark sends 1000 at once)
    tool_call_parser: str = "hermes"  # how tool calls are found in the output: hermes, llama3_json, mistral
    reasoning_parser: str | None = None  # how the thinking is told from the answer (reasoning.py); None: not
    chat_template: str | None = None  # a Jinja chat template that replaces the tokenizer's
    sampling_defaults: dict = field(default_factory=dict)  # request field -> default (generation_config.json)
    cors_origins: tuple[str, ...] = ()  # browsers on these origins may call the API (CORS); "*" for any
    engine_threads: int | None = None  # torch threads of the engine thread (engine_loop.reserve_torch_threads)
    trust_request_chat_template: bool = False  # else a request's chat_template is a 400 (a template is a program)
    escape_special_tokens: bool = False  # special tokens in chat content are tokenized as text (chat_template.py)
    chat_template_timeout_s: float = 2.0  # a render that runs longer is a 400
    max_rendered_chat_chars: int = 16 << 20  # a longer rendered chat is a 400
    max_logprob_entries: int = 200_000  # prompt logprobs: prompt tokens x (logprobs + 1) x n; 400 above
    responses_store_max_count: int = 1000  # /v1/responses store=true: most stored responses (LRU beyond)
    responses_store_max_bytes: int = 64 << 20  # ... and most bytes of JSON they hold
    responses_store_dir: str | None = None  # ... kept as files there (they survive a restart); None: in memory
    media_limits: MediaLimits = field(default_factory=MediaLimits)  # images: sources, count, bytes, pixels (media.py)

    named_keys: dict[str, str] = field(init=False, repr=False, default_factory=dict)  # every key, by name
    tenant_isolation: bool = field(init=False, default=False)  # keys are tenants kept apart (tenancy.py)

    def __post_init__(self) -> None:
        if isinstance(self.api_key, (list, tuple)):  # --api-key given once is the one key, as before
            self.api_key = None if not self.api_key else self.api_key[0] if len(self.api_key) == 1 else list(
                self.api_key)
        self.named_keys = named_api_keys(self.api_key, self.api_keys)
        self.tenant_isolation = has_tenants(self.api_key, self.api_keys)
        if self.prefix_cache_isolation not in PREFIX_CACHE_ISOLATION:
            raise ValueError(f"--prefix-cache-isolation {self.prefix_cache_isolation!r}: choose one of "
                             f"{', '.join(PREFIX_CACHE_ISOLATION)}")
        if self.prefix_cache_isolation == "key" and not self.named_keys:
            raise ValueError("--prefix-cache-isolation key needs API keys (--api-key NAME=KEY)")
        if self.reasoning_parser is not None and self.reasoning_parser not in PARSER_NAMES:
            raise ValueError(f"--reasoning-parser {self.reasoning_parser!r}: choose one of {', '.join(PARSER_NAMES)}")
        if self.tool_call_parser == "openai" and self.reasoning_parser not in ("openai_gptoss", "auto"):
            raise ValueError("--tool-call-parser openai (gpt-oss's harmony) needs --reasoning-parser openai_gptoss: "
                             "it reads the channels, whose markers are special tokens")
        self.metrics_keys = tuple(self.metrics_keys)
        unknown = [name for name in self.metrics_keys if name not in self.named_keys]
        if unknown:
            raise ValueError(f"--metrics-key {', '.join(unknown)}: no API key has that name "
                             f"(names: {', '.join(self.named_keys) or 'none'})")
        media = self.media_limits
        if min(media.max_images, media.max_bytes, media.max_pixels) < 0 or media.fetch_timeout_s <= 0:
            raise ValueError(f"image limits must be positive: {media}")
        for name in ("max_json_depth", "max_request_items", "max_embedding_inputs", "max_detokenize_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(self, name)!r}")
