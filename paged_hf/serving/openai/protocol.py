"""Pydantic models of the OpenAI wire format: what the server accepts and what it answers.

Requests are validated here, so a field of the wrong type or out of range is a 400 with the field's name
before anything reaches the engine. Strict: every field is honoured, accepted only at its neutral value, or
ignored because it cannot change the answer (request_fields.py); an unknown field is a 400 naming it. An
explicit `null` means the field's default, as in OpenAI's API.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from paged_hf.serving.openai.request_fields import CHAT_REFUSED_UNLESS, COMPLETION_REFUSED_UNLESS, IGNORED, refusal
from paged_hf.serving.openai.structured import ResponseFormat
from paged_hf.serving.openai.tool_calls import ChatTool, DeltaToolCall, ToolCall, ToolChoice

StopField = str | list[str] | None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    continuous_usage_stats: Literal[False] = False  # vLLM: usage in every chunk (not supported)


class OpenAIRequest(BaseModel):
    """Strict: unknown fields are a 400; null means the default; `IGNORED` fields are dropped."""

    model_config = ConfigDict(extra="forbid")
    refused_unless: ClassVar[dict[str, tuple]] = {}

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data):
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if v is not None and k not in IGNORED}
        return data

    @field_validator("*", mode="before")
    @classmethod
    def _refuse_what_we_cannot_honour(cls, value, info):
        neutral = cls.refused_unless.get(info.field_name)
        if neutral is not None:
            message = refusal(info.field_name, value, neutral)
            if message:
                raise ValueError(message)
        return value


def _with_refused(name: str, table: dict[str, tuple]) -> type[OpenAIRequest]:
    """A base model that declares every field of `table` (so a non-neutral value is a 400 naming it)."""
    model = create_model(name, __base__=OpenAIRequest, **{field: (Any, None) for field in table})
    model.refused_unless = table
    return model


class SamplingFields(BaseModel):
    """The fields completions and chat share; ranges follow OpenAI's API reference, extensions vLLM's."""

    model: str | None = None  # None: the base model
    n: int = Field(1, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)  # None: OpenAI's default, 1.0
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # vLLM extension
    min_p: float | None = Field(None, ge=0.0, le=1.0)  # vLLM extension
    repetition_penalty: float | None = Field(None, gt=0.0)  # vLLM extension
    max_tokens: int | None = Field(None, ge=1)
    stop: StopField = None
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[int, float] | None = None  # OpenAI: token id (a JSON string key) -> bias in [-100, 100]
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extensions
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    allowed_token_ids: list[int] | None = Field(None, min_length=1)
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # keep the last k prompt tokens; -1: max_model_len
    add_special_tokens: bool | None = None  # None: True for completions, False for chat (as vLLM)
    response_format: ResponseFormat | None = None  # text, json_object, json_schema (enforced by a grammar)
    structured_outputs: dict[str, Any] | None = None  # vLLM extension: json, regex, choice, grammar, json_object
    # vLLM's extension: lower is served first; needs --scheduling-policy priority (else only 0 is accepted)
    priority: int = Field(0, strict=True)
    user: str | None = Field(None, min_length=1, max_length=256)  # OpenAI: the end user; the tenant under fair
    # vLLM's: disaggregated prefill/decode (serving/openai/kv_transfer.py); ignored without --kv-transfer-config
    kv_transfer_params: dict[str, Any] | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: StopField) -> list[str] | None:
        """OpenAI allows one string or up to 4; empty strings would stop at once, so they are refused."""
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else list(value)
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stops or None

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, value: dict[int, float] | None) -> dict[int, float] | None:
        if value and any(not -100 <= bias <= 100 for bias in value.values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        return value


class CompletionRequest(SamplingFields, _with_refused("_CompletionRefused", COMPLETION_REFUSED_UNLESS)):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)  # 0: with echo, the prompt alone (scoring)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # tool calls, names...: the chat template may use them

    role: str
    content: str | list[dict] | None = None

    def text(self) -> str:
        """The content as one string: text parts of a multi-part message are joined, others refused."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"only text content parts are supported, got type {part.get('type')!r}")
            parts.append(part["text"])
        return "".join(parts)

    def parts(self) -> list[dict]:
        """The content as HF's multimodal parts (what a processor's chat template reads): text parts, and
        `{"type": "image"}` where an `image_url` part is (its image goes to the processor: chat_images.py)."""
        if self.content is None or isinstance(self.content, str):
            return [{"type": "text", "text": self.content}] if self.content else []
        parts = []
        for part in self.content:
            if part.get("type") == "image_url":
                parts.append({"type": "image"})
            elif part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            else:
                raise ValueError(f"only text and image_url content parts are supported, got type {part.get('type')!r}")
        return parts


class ChatCompletionRequest(SamplingFields, _with_refused("_ChatRefused", CHAT_REFUSED_UNLESS)):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, "none" without
    parallel_tool_calls: bool | None = None  # accepted; a model may always write several calls
    chat_template: str | None = None  # a Jinja template for this request (HF's sandboxed renderer)
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false}
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # to the chat template as `reasoning_effort` (a template that does not read it: 400)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    include_reasoning: bool = True  # false: the reasoning (--reasoning-parser) is left out of the answer
    thinking_token_budget: int | None = Field(None, ge=0)  # past this many tokens the thinking is closed


# --- responses ------------------------------------------------------------------------------------------------

class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # found in the prefix cache or the KV tier, not computed


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # the thinking's, with --reasoning-parser


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


class PromptLogprob(BaseModel):
    """vLLM's Logprob: one candidate token of a prompt position."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM: the stop token id or stop string that ended it
    prompt_logprobs: list[dict[int, "PromptLogprob"] | None] | None = None  # vLLM's prompt_logprobs


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a KV producer's: where its prompt blocks are


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ChatMessageOut(BaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning: str | None = None  # the thinking, with --reasoning-parser
    reasoning_content: str | None = None  # the same under its older name (DeepSeek's API; vLLM's until 2026)
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_logprobs: list[dict[int, "PromptLogprob"] | None] | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a KV producer's: where its prompt blocks are


class ChatDelta(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None  # as in ChatMessageOut
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "paged_hf"
    root: str | None = None  # the base model an adapter applies to
    parent: str | None = None
    max_model_len: int | None = None  # vLLM's: prompt and completion tokens together (clients size chats by it)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
