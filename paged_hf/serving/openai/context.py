"""What a handler works with: the server's context (`ServerContext`) and a checked request (`Prepared`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from paged_hf.integrations.peft import adapter_folder_under
from paged_hf.sampling_params import SamplingParams
from paged_hf.serving.openai.chat_template import TemplatePolicy
from paged_hf.serving.openai.errors import ApiError
from paged_hf.serving.openai.media import MediaLimits
from paged_hf.serving.openai.reasoning import ReasoningParser
from paged_hf.serving.openai.tenancy import AdapterOwners
from paged_hf.serving.openai.tool_calls import ToolMode


@dataclass
class Prepared:
    """A checked request, ready for the engine."""

    request_id: str
    model: str
    adapter: str | None
    prompts: list[list[int]]  # token ids; several for a batched /v1/completions request
    params: SamplingParams
    stream: bool
    include_usage: bool
    chat: bool
    arrival_time: float
    tools: ToolMode = field(default_factory=ToolMode)
    reasoning: ReasoningParser | None = None  # chat with --reasoning-parser: tells the thinking from the answer
    include_reasoning: bool = True  # false: the thinking is left out of the answer
    cache_salt: str | None = None
    echo: bool = False  # /v1/completions: the prompt comes back before the completion
    echo_only: bool = False  # echo with max_tokens=0: the prompt alone (one token is computed and dropped)
    prompt_texts: list[str | None] = field(default_factory=list)  # the prompts as sent (echo)
    priority: int = 0  # lower first (--scheduling-policy priority)
    tenant: str | None = None  # the `user` field, else the API key's name; None: the engine takes the adapter
    key_name: str | None = None  # the API key's name (tenancy.py: the owner, the prefix cache's salt)
    processed: object = None  # a chat with images: the engine's processed prompt (ids, image items; chat_images.py)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.prompts[0]

    def engine_prompt(self, index: int):
        """What the engine gets for prompt `index`: its token ids, or the processed prompt with its images."""
        return self.processed if self.processed is not None else self.prompts[index]

    def engine_request_id(self, index: int) -> str:
        return self.request_id if len(self.prompts) == 1 else f"{self.request_id}-{index}"


@dataclass
class ServerContext:
    """What the handlers need: the engine loop, the tokenizer, the served names and the limits."""

    engine: object  # EngineLoop
    tokenizer: object
    model_name: str
    settings: object  # ServerSettings
    max_model_len: int
    metrics: object  # ServerMetrics
    served_names: tuple[str, ...] = ()  # every name of the base model (--served-model-name a b ...)
    adapter_owners: AdapterOwners = field(default_factory=AdapterOwners)  # adapters keys loaded (tenancy.py)
    kv_transfer: object = None  # KVTransfer with --kv-transfer-config (kv_transfer.py), else None
    processor: object = None  # a vision-language model's processor (create_app's tokenizer was one), else None

    @property
    def chat_template(self) -> str | None:
        """The server's --chat-template, else the processor's (None: the tokenizer's)."""
        return self.settings.chat_template or getattr(self.processor, "chat_template", None)

    @property
    def media_limits(self) -> MediaLimits:
        return self.settings.media_limits

    @property
    def max_schema_depth(self) -> int:
        """The engine's --max-grammar-depth: every JSON schema a request carries is held to it (schema_limits.py)."""
        return self.engine.limits.max_grammar_depth

    @property
    def template_policy(self) -> TemplatePolicy:
        s = self.settings
        return TemplatePolicy(s.trust_request_chat_template, s.escape_special_tokens, s.chat_template_timeout_s,
                              s.max_rendered_chat_chars)

    def resolve_model(self, name: str | None, owner: str | None = None) -> str | None:
        """Model name -> the engine's adapter (None = the base model). Adapters are served under their own names;
        one that a key loaded at run time, only to that key (`owner`, tenancy.py): to others it does not exist."""
        if name is None or name == self.model_name or name in self.served_names:
            return None
        own = self.adapter_owners.own(name, owner, self.engine.adapter_names)
        if own is not None:
            return own
        if name not in self.adapter_owners.owned:  # an owned adapter's engine name is nobody's model name
            if name in self.engine.adapter_names:
                return name
            root = self.engine.limits.lora_root
            if root is not None and adapter_folder_under(root, name) is not None:
                return name  # the engine reads it on first use
        raise ApiError(404, f"The model {name!r} does not exist; served: "
                       f"{[*(self.served_names or (self.model_name,)), *self.adapters_seen_by(owner)]}",
                       "model_not_found", "model")

    def adapters_seen_by(self, owner: str | None) -> list[str]:
        """The adapter names a key with `owner` may use: the command line's, and those it loaded itself."""
        owners = self.adapter_owners
        return list(dict.fromkeys(owners.client_name(name) for name in self.engine.adapter_names
                                  if owners.visible(name, owner)))
