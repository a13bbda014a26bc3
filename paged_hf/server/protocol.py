"""Pydantic models of the OpenAI wire format: what the server accepts and what it answers.

Requests are validated here, so a field of the wrong type or out of range is a 400 with the field's name
before anything reaches the engine. Unknown fields are ignored (OpenAI clients send many, e.g. `user`), but
fields whose meaning we cannot honour (`echo`, `suffix`, `best_of` != n) are rejected rather than silently
dropped: a silently wrong answer is worse than an error.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .structured import ResponseFormat
from .tool_calls import ChatTool, DeltaToolCall, ToolCall, ToolChoice

StopField = str | list[str] | None


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """The fields completions and chat share; ranges follow OpenAI's API reference."""

    model_config = ConfigDict(extra="ignore")

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
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM extension
    response_format: ResponseFormat | None = None  # text, json_object, json_schema (enforced by a grammar)
    structured_outputs: dict[str, Any] | None = None  # vLLM extension: json, regex, choice, grammar, json_object

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


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported")
        return value


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


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, "none" without
    parallel_tool_calls: bool | None = None  # accepted; a model may always write several calls


# --- responses ------------------------------------------------------------------------------------------------

class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


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


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


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
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ChatDelta(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


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


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
