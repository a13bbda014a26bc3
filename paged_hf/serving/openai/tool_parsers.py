"""Finding tool calls in a model's text, one parser per format (vLLM's `--tool-call-parser` names).

- hermes (Hermes, Qwen): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, after content.
- llama3_json (Llama 3.x): the whole output is `{"name": ..., "parameters": {...}}` (optionally after
  `<|python_tag|>`), several separated by `;`.
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` after content.
- granite (Granite 3.x): the whole output is `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]`.
- pythonic (Llama 3.2, Llama 4): the whole output is `[func_a(x=1, y='s'), func_b()]`.
- qwen3_coder (Qwen3-Coder): `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>...</function>
  \\n</tool_call>` blocks after content.
- glm45 (GLM-4.5, 4.6): `<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>...</tool_call>`
  blocks after content.
- deepseek_v3, deepseek_v31 (DeepSeek V3, V3.1) and kimi_k2 (Kimi K2): a section of calls in the model's
  special tokens after content.
- openai (gpt-oss): harmony messages to `functions.NAME` (with --reasoning-parser openai_gptoss).

Each parser also writes calls in its own format (for templates that cannot render tools) and says how much
of a running text is surely content (a stream holds back what may be the start of a call). The formats live in
the tool_formats/ folder beside this module, one module per kind.
"""

from __future__ import annotations

import json

from paged_hf.serving.openai.tool_formats.base import CallSoFar, ToolParser, json_call, object_calls, skip_space
from paged_hf.serving.openai.tool_formats.harmony_calls import HarmonyParser
from paged_hf.serving.openai.tool_formats.json_calls import (
    GraniteParser,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    as_written,
)
from paged_hf.serving.openai.tool_formats.pythonic import PythonicParser
from paged_hf.serving.openai.tool_formats.special_tokens import DeepSeekV3Parser, DeepSeekV31Parser, KimiK2Parser
from paged_hf.serving.openai.tool_formats.tagged import Glm45Parser, Qwen3CoderParser

PARSERS: dict[str, ToolParser] = {
    "hermes": HermesParser(), "llama3_json": Llama3JsonParser(), "mistral": MistralParser(),
    "granite": GraniteParser(), "pythonic": PythonicParser(), "qwen3_coder": Qwen3CoderParser(),
    "glm45": Glm45Parser(), "deepseek_v3": DeepSeekV3Parser(), "deepseek_v31": DeepSeekV31Parser(),
    "kimi_k2": KimiK2Parser(), "openai": HarmonyParser(),
}


def parse_required(text: str) -> list[tuple[str, str]]:
    """The calls of a "required" answer (a JSON list of {"name", "arguments"}), their arguments as written; []
    if it is not one."""
    try:
        values = json.loads(text)
    except ValueError:
        return []
    parsed = [json_call(v) for v in values] if isinstance(values, list) else [None]
    return [] if None in parsed else as_written(parsed, required_calls_so_far(text))


def required_calls_so_far(text: str) -> list[CallSoFar]:
    """The calls of a running "required" answer as far as they are written (streamed as they grow)."""
    start = skip_space(text, 0)
    return object_calls(text, start + 1) if text.startswith("[", start) else []


def tool_text(tokenizer, token_ids: list[int], parser: ToolParser) -> str:
    """The sequence's text with the parser's markers kept even where they are special tokens (Mistral's
    [TOOL_CALLS], DeepSeek's and Kimi's call tokens); other special tokens (EOS...) are dropped as in the
    normal text."""
    if tokenizer is None:
        return ""
    text = tokenizer.decode(token_ids, skip_special_tokens=False)
    kept = {parser.marker, *parser.inner_markers}
    for special in getattr(tokenizer, "all_special_tokens", []):
        if special and special not in kept:
            text = text.replace(special, "")
    return text
