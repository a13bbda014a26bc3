"""Pydantic models of OpenAI's Responses API request (`POST /v1/responses`).

Strict like the other routes: every field is honoured, accepted only at its neutral value (`REFUSED_UNLESS`: a
400 naming it otherwise), or ignored because it cannot change the answer (`IGNORED`); an unknown field is a 400.
`input` items are checked where they are translated (responses.py), so a bad item's 400 names its index.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from paged_hf.serving.openai.request_fields import refusal

_NONE, _FALSE = (None,), (None, False)

#: Accepted and ignored: billing, monitoring and caching hints that never change the answer.
IGNORED = frozenset({"metadata", "service_tier", "safety_identifier", "prompt_cache_key",
                     "prompt_cache_retention", "stream_options"})

#: field -> the values that mean "off"; anything else is a 400 naming the field.
REFUSED_UNLESS = {
    "background": _FALSE,
    "conversation": _NONE,
    "prompt": _NONE,
    "include": (None, []),  # e.g. reasoning.encrypted_content: this server keeps no encrypted thinking
    "top_logprobs": (None, 0),
    "max_tool_calls": _NONE,
    "truncation": (None, "disabled"),
    "context_management": _NONE,
}


class StrictRequest(BaseModel):
    """Unknown fields are a 400; null means the default; `ignored` fields are dropped; a `refused_unless` field
    (declared with `refusable`) is a 400 naming it unless neutral."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    ignored: ClassVar[frozenset] = frozenset()
    refused_unless: ClassVar[dict[str, tuple]] = {}

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data):
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if v is not None and k not in cls.ignored}
        return data

    @field_validator("*", mode="before")
    @classmethod
    def _refuse_what_we_cannot_honour(cls, value, info):
        neutral = cls.refused_unless.get(info.field_name)
        message = refusal(info.field_name, value, neutral) if neutral is not None else None
        if message:
            raise ValueError(message)
        return value


def refusable(name: str, table: dict[str, tuple], ignored: frozenset) -> type[StrictRequest]:
    """A base model that declares every field of `table` (so a non-neutral value is a 400 naming it)."""
    model = create_model(name, __base__=StrictRequest, **{field: (Any, None) for field in table})
    model.refused_unless, model.ignored = table, ignored
    return model


class FunctionTool(BaseModel):
    """A function tool in the Responses shape (flat: no nested "function"); other tool types are a 400."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    """`text.format`: plain text, any JSON object, or JSON that follows `schema` (enforced by the grammar)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # a reasoning model's knob: only its neutral value

    @field_validator("verbosity", mode="before")
    @classmethod
    def _neutral_verbosity(cls, value):
        message = refusal("text.verbosity", value, (None, "medium"))
        if message:
            raise ValueError(message)
        return value


class ReasoningConfig(BaseModel):
    """`reasoning`: `effort` goes to the chat template (as the chat route's reasoning_effort); summaries are
    not written, so `summary` is accepted only as "auto" (OpenAI's answer may have none: here it has none)."""

    model_config = ConfigDict(extra="forbid")

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: str | None = None
    generate_summary: str | None = None  # the older name of summary

    @field_validator("summary", "generate_summary", mode="before")
    @classmethod
    def _no_summaries(cls, value, info):
        if value not in (None, "auto"):
            raise ValueError(f"reasoning.{info.field_name}={value!r} is not supported: this server writes no "
                             "summaries of the thinking (accepted: null or 'auto'; the thinking itself comes back "
                             "as the reasoning item's content)")
        return value


class ResponsesRequest(refusable("_ResponsesRefused", REFUSED_UNLESS, IGNORED)):
    model: str | None = None
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None  # accepted; a model may always write several calls
    text: TextConfig | None = None
    user: str | None = None  # the end user: passed to the chat path as its `user`
    reasoning: ReasoningConfig | None = None
    # vLLM's extensions, as on the chat route
    seed: int | None = None
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
