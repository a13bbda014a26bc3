"""OpenAI's `response_format` and vLLM's `structured_outputs` field -> the engine's StructuredOutputsParams.

The request models (protocol.py) check the shapes; this turns them into one grammar spec per request. A
schema the grammar compiler cannot use is found in the engine, at submission: a 400 naming the problem too.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from paged_hf.sampling_params import StructuredOutputsParams
from paged_hf.serving.openai.errors import ApiError


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`: the schema is enforced whether `strict` is set or not."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


def structured_outputs(request) -> StructuredOutputsParams | None:
    """The request's grammar spec from `response_format` or `structured_outputs` (at most one of them)."""
    response_format: ResponseFormat | None = getattr(request, "response_format", None)
    fields: dict | None = getattr(request, "structured_outputs", None)
    wants_format = response_format is not None and response_format.type != "text"
    if wants_format and fields is not None:
        raise ApiError(400, "use response_format or structured_outputs, not both", "invalid_request",
                       "structured_outputs")
    if fields is not None:
        try:
            return StructuredOutputsParams(**fields)
        except (TypeError, ValueError) as exc:
            raise ApiError(400, str(exc).replace("__init__()", "structured_outputs"), "invalid_request",
                           "structured_outputs") from None
    if not wants_format:
        return None
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if response_format.json_schema is None or response_format.json_schema.schema_ is None:
        raise ApiError(400, "response_format of type json_schema needs json_schema.schema", "invalid_request",
                       "response_format")
    return StructuredOutputsParams(json=response_format.json_schema.schema_)
