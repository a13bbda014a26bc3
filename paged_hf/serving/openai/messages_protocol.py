"""Pydantic models of Anthropic's Messages API request (`POST /v1/messages`).

Strict like the other routes (responses_protocol.StrictRequest): honoured, refused unless neutral (a 400
naming the field), ignored when it cannot change the answer, else unknown (a 400). Content blocks are checked
where they are translated (messages.py), so a bad block's 400 names its place.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from paged_hf.serving.openai.responses_protocol import refusable

#: Accepted and ignored: they never change the answer.
IGNORED = frozenset({"service_tier", "cache_control", "inference_geo", "speed", "diagnostics",
                     "user_profile_id", "workspace_id"})

#: field -> the values that mean "off".
REFUSED_UNLESS = {
    "container": (None,),
    "mcp_servers": (None, []),
    "context_management": (None,),
    "output_config": (None,),
}


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class AnthropicTool(BaseModel):
    """A client tool (`input_schema`: a JSON schema); server tools (web search, bash...) are a 400."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None  # a prompt-caching hint: ignored


class AnthropicToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None  # accepted; a model may always write several calls


class AnthropicThinking(BaseModel):
    """`enabled` (with a budget) and `adaptive` give thinking blocks (the server's --reasoning-parser tells them
    from the answer); `disabled` leaves the thinking out."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = Field(None, ge=1)  # enabled: past this many tokens the thinking is closed


class MessagesRequest(refusable("_MessagesRefused", REFUSED_UNLESS, IGNORED)):
    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    metadata: dict[str, Any] | None = None  # its `user_id` is passed to the chat path as `user`; the rest ignored
    thinking: AnthropicThinking | None = None

    @field_validator("stop_sequences")
    @classmethod
    def _non_empty(cls, value: list[str] | None) -> list[str] | None:
        if value and any(not s for s in value):
            raise ValueError("stop sequences must be non-empty")
        return value or None
