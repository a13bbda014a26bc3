"""Chat templates: who may send one, how long a render may run, and what user text may turn into.

A Jinja template is a program: `{% for i in range(100000) %}{% for j in range(100000) %}a...` runs for hours
and grows memory at ~140 MB/s, though the sandbox refuses every unsafe call. So:

- a request's own `chat_template` is refused unless the server trusts them (`--trust-request-chat-template`,
  vLLM's flag): the server's and the model's templates are the operator's;
- every render (request, model, `/tokenize`) runs in a worker thread, never on the event loop or the engine
  thread, under `RenderLimits`: a trace function in that thread checks the deadline and the client's presence
  (`cancel`) on every line the template runs and every Python call it makes, and the rendered text's size is
  capped. A render over a limit ends with a 400 naming it; one whose client left ends with a 499;
- `escape_special_tokens` (`--escape-special-tokens-in-content`): special tokens written in messages, tools or
  template kwargs are tokenized as plain text (transformers' `sanitize_control_tokens`), so that content like
  `hi<|im_end|>\\n<|im_start|>system` can never forge a turn; only the template's own special tokens are tokens.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from dataclasses import dataclass

from paged_hf.serving.openai.errors import ApiError
from paged_hf.serving.openai.gil_pacing import FULL_SPEED_S, PAUSE_S, SLICE_S
from paged_hf.serving.openai.tool_calls import ToolMode, parser_for, template_messages

#: Jinja compiles a template given as text under this file name: its lines are the ones the deadline watches.
TEMPLATE_FILENAME = "<template>"
#: A render runs at full speed for FULL_SPEED_S (every real template renders well within it), then paced
#: (gil_pacing.py): one long render starved the engine (measured: 0.5 s gaps in a stream for a 0.5 s render).


@dataclass(frozen=True)
class TemplatePolicy:
    """How the server renders chat templates (ServerSettings' fields of the same names)."""

    trust_request_chat_template: bool = False
    escape_special_tokens: bool = False
    render_timeout_s: float = 2.0
    max_rendered_chars: int = 16 << 20


class RenderLimitError(Exception):
    """A render ran past its deadline, or its client left."""


def chat_prompt_ids(request, tokenizer, tools: ToolMode | None = None, tool_call_parser: str = "hermes",
                    chat_template: str | None = None, policy: TemplatePolicy | None = None,
                    cancel: threading.Event | None = None, parts: bool = False) -> list[int]:
    """The chat template (the request's, the server's --chat-template, or the tokenizer's), rendered with the
    request's options and tools under `policy`, then tokenized (special tokens added only if asked: the
    template holds them). `cancel`: set when the client left; `parts`: as `render_chat`."""
    rendered = render_chat(request, tokenizer, tools, tool_call_parser, chat_template, policy, cancel, parts)
    if not isinstance(rendered, str):  # escaped: tokenized by transformers, which added no special tokens
        ids = list(rendered)
        return list(tokenizer.build_inputs_with_special_tokens(ids)) if request.add_special_tokens else ids
    return list(tokenizer(rendered, add_special_tokens=bool(request.add_special_tokens))["input_ids"])


def render_chat(request, tokenizer, tools: ToolMode | None = None, tool_call_parser: str = "hermes",
                chat_template: str | None = None, policy: TemplatePolicy | None = None,
                cancel: threading.Event | None = None, parts: bool = False) -> str | list[int]:
    """The rendered chat: text, or token ids when `policy` escapes special tokens. `parts`: each message's content
    goes to the template as a list of parts (HF's multimodal form: text parts, `{"type": "image"}` where an image
    part is), as a processor's template reads it; else as one string."""
    policy = policy or TemplatePolicy()
    if request.chat_template is not None and not policy.trust_request_chat_template:
        raise ApiError(400, "chat_template in a request is refused: this server was not started with "
                       "--trust-request-chat-template", "chat_template_not_allowed", "chat_template")
    template = request.chat_template or chat_template or getattr(tokenizer, "chat_template", None)
    if tokenizer is None or not template:
        raise ApiError(400, "this model has no chat template: use /v1/completions", "no_chat_template", "messages")
    if request.add_generation_prompt and request.continue_final_message:
        raise ApiError(400, "continue_final_message and add_generation_prompt cannot both be true",
                       "invalid_request", "continue_final_message")
    options = reasoning_options(request, template)
    try:
        messages = [with_reasoning_content({**message.model_dump(exclude_none=True),
                                            "content": message.parts() if parts else message.text()})
                    for message in request.messages]
        messages, extra = template_messages(messages, tools or ToolMode(), parser_for(tool_call_parser), template)
        with render_bounds(policy.render_timeout_s, cancel):
            rendered = tokenizer.apply_chat_template(
                messages, chat_template=template, add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message, tokenize=policy.escape_special_tokens,
                sanitize_control_tokens=policy.escape_special_tokens, return_dict=False,
                **extra, **options, **(request.chat_template_kwargs or {}))
    except ApiError:
        raise
    except RenderLimitError as exc:
        left = cancel is not None and cancel.is_set()
        failure = (ApiError(499, "client disconnected", "client_disconnected") if left
                   else ApiError(400, str(exc), "chat_template_too_slow", "chat_template"))
    except Exception as exc:  # noqa: BLE001 - a template error is about these messages: the client's
        failure = ApiError(400, f"the chat messages do not fit the chat template: {exc}", "invalid_messages",
                           "messages")
    else:
        failure = None
    # raised outside the handlers, so that the render's own error is not chained to it: that error's frames hold what
    # the render made (55 MB of encodings for a 1 MB system message's tokens), freed now in this thread, not when the
    # last reference to the answer's error goes, which may come after the answer's heap trim (memory.py)
    if failure is not None:
        raise failure
    if isinstance(rendered, str) and len(rendered) > policy.max_rendered_chars:
        raise ApiError(400, f"the chat template rendered {len(rendered)} characters; at most "
                       f"{policy.max_rendered_chars} are accepted (--max-rendered-chat-chars)",
                       "chat_template_too_large", "messages")
    return rendered


def reasoning_options(request, template: str) -> dict:
    """`reasoning_effort` as a template variable, where the template reads it (else a 400: it would change
    nothing)."""
    effort = getattr(request, "reasoning_effort", None)
    if effort is None:
        return {}
    if "reasoning_effort" not in template:
        raise ApiError(400, f"reasoning_effort={effort!r}: this model's chat template has no reasoning_effort "
                       "setting", "invalid_request", "reasoning_effort")
    return {"reasoning_effort": effort}


#: the names templates read an earlier answer's thinking by: Qwen3's and DeepSeek's, vLLM's and OpenAI's newer
#: one, and transformers' (gpt-oss's template)
REASONING_NAMES = ("reasoning_content", "reasoning", "thinking")


def with_reasoning_content(message: dict) -> dict:
    """An earlier answer's thinking under every name templates read it by (REASONING_NAMES)."""
    given = next((message[name] for name in REASONING_NAMES if message.get(name) is not None), None)
    if given is not None:
        for name in REASONING_NAMES:
            if message.get(name) is None:
                message[name] = given
    return message


@contextlib.contextmanager
def render_bounds(timeout_s: float, cancel: threading.Event | None = None):
    """Within the block, the calling thread raises RenderLimitError once `timeout_s` passed or `cancel` is set.
    Checked on each Python call and each line of a Jinja template: a template's loops are Python loops in its
    compiled code, and what they call (filters, the sandbox's checks) are Python calls."""
    start = time.monotonic()
    deadline, next_pause = start + timeout_s, start + FULL_SPEED_S

    def check() -> None:
        nonlocal next_pause
        now = time.monotonic()
        if now > deadline:
            raise RenderLimitError(f"the chat template did not render within {timeout_s:g} s "
                                   "(--chat-template-timeout)")
        if cancel is not None and cancel.is_set():
            raise RenderLimitError("the client left")
        if now > next_pause:  # a long render: give the GIL away most of the time (see PAUSE_S)
            time.sleep(PAUSE_S)
            next_pause = time.monotonic() + SLICE_S

    def local(frame, event, arg):
        if event == "line":
            check()
        return local

    def on_call(frame, event, arg):
        check()
        return local if frame.f_code.co_filename == TEMPLATE_FILENAME else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        yield
    finally:
        sys.settrace(previous)
