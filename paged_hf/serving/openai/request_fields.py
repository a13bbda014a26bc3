"""Which request fields the server accepts without honouring them, and which it refuses.

Every field of vLLM's completion and chat request models is either honoured (a field of the pydantic models in
protocol.py), accepted only at its neutral value (`REFUSED_UNLESS`: any other value is a 400 naming the field,
never a 200 with a different answer than asked for), or harmless and ignored (`IGNORED`: it does not change the
answer). Anything else is an unknown field: a 400 too. docs/serving.md has the table.
"""

from __future__ import annotations

#: Accepted and ignored: they never change the answer.
IGNORED = frozenset({
    "request_id",  # vLLM: an internal id (responses keep our own ids)
    "session_id",  # vLLM: a routing hint
    "store", "metadata", "service_tier",  # OpenAI: storage and billing of the request
    "stream_interval",  # vLLM: tokens per streamed chunk (the streamed text adds up the same)
})

_NONE = (None,)
_FALSE = (None, False)

#: field -> the values that mean "off" (None is always one of them: null means the default).
_SHARED = {
    "use_beam_search": _FALSE,
    "watermarking": _FALSE,
    "length_penalty": (None, 1.0),
    "spaces_between_special_tokens": (None, True),
    "truncation_side": (None, "left"),
    "logprob_token_ids": _NONE,
    "return_tokens_as_token_ids": _FALSE,
    "return_token_ids": _FALSE,
    "return_token_offsets": _FALSE,
    "routed_experts_prompt_start": (None, 0),
    "mm_payload": (None, "tensors"),
    "return_mm_kwargs": _FALSE,
    "ec_transfer_params": _NONE,
    "vllm_xargs": _NONE,
    "repetition_detection": _NONE,
}
COMPLETION_REFUSED_UNLESS = {**_SHARED, "prompt_embeds": _NONE, "suffix": (None, ""), "thinking_token_budget": _NONE}
CHAT_REFUSED_UNLESS = {
    **_SHARED,
    "echo": _FALSE,
    "documents": _NONE,
    "media_io_kwargs": _NONE,
    "mm_processor_kwargs": _NONE,
    "return_prompt_text": _FALSE,
}


def refusal(name: str, value, neutral: tuple) -> str | None:
    """The 400 message for `value` of a field we only accept at `neutral`, or None when it is neutral."""
    if any(value == ok and isinstance(value, bool) == isinstance(ok, bool) for ok in neutral):
        return None
    accepted = " or ".join("null" if ok is None else repr(ok) for ok in neutral)
    return f"{name}={value!r} is not supported by this server (accepted: {accepted})"
