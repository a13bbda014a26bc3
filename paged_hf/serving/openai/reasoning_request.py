"""A chat request's reasoning: which parser tells its thinking from its answer (reasoning.py), and what the
engine is told of the thinking (paged_hf/sample/thinking.py): where it ends, so that a grammar holds from there,
whether it is optional, and the request's budget."""

from __future__ import annotations

import dataclasses

from paged_hf.sampling_params import SamplingParams
from paged_hf.serving.openai.errors import ApiError
from paged_hf.serving.openai.reasoning import ReasoningParser, parser_for

#: How much of the end of a chat prompt is read for a thinking the template opened or closed.
PROMPT_TAIL_TOKENS = 32


def reasoning_parser(ctx, request, prompt: list[int], params: SamplingParams) -> ReasoningParser | None:
    """The --reasoning-parser for this chat request, told whether its rendered prompt already closed the
    thinking (the prompt's last tokens are enough: a template closes it right before the answer). None where a
    grammar holds from the first token (the engine cannot find this parser's thinking): the output is the
    answer."""
    name = ctx.settings.reasoning_parser
    if name is None:
        return None
    template = request.chat_template or ctx.settings.chat_template or getattr(ctx.tokenizer, "chat_template", None)
    tail = ctx.tokenizer.decode(prompt[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
    parser = parser_for(name, template, tail, request.chat_template_kwargs)
    if params.structured_outputs is not None and not parser.prompt_ends_thinking and gate(ctx, parser) is None:
        return None
    return parser


def thinking_params(ctx, request, parser: ReasoningParser | None, params: SamplingParams) -> SamplingParams:
    """The engine told where the thinking ends (its grammar holds from there), whether it is optional, and the
    request's budget; the parser's markers stay in the text even where they are special tokens (Magistral's
    [THINK], gpt-oss's channels)."""
    budget = request.thinking_token_budget
    if parser is not None and parser.markers:  # where they are special tokens, the text keeps them all the same
        params = dataclasses.replace(params, kept_special_tokens=list(parser.markers))
    markers = None if parser is None or parser.prompt_ends_thinking else gate(ctx, parser)
    if budget is not None and (markers is None or parser.answer_marker):
        if parser is not None and parser.prompt_ends_thinking:
            return params  # (no thinking to budget)
        raise ApiError(400, "thinking_token_budget needs --reasoning-parser deepseek_r1, qwen3 or mistral (a "
                       "thinking that ends with its marker)", "invalid_request", "thinking_token_budget")
    if markers is None:
        return params
    end, start = markers
    return dataclasses.replace(params, thinking_end_token_ids=end, thinking_start_token_id=start,
                               thinking_token_budget=budget)


def gate(ctx, parser: ReasoningParser) -> tuple[list[int], int | None] | None:
    """(the end marker's token ids, the optional start marker's one token id or None) where the engine can follow
    this parser's thinking; None where it cannot (markers written as text, or an optional thinking whose start
    is not one token). Harmony's: the final channel's header, whether an analysis came before it or not."""
    if parser.answer_marker:
        answer = list(ctx.tokenizer(parser.answer_marker, add_special_tokens=False)["input_ids"])
        return None if ctx.tokenizer.unk_token_id in answer else (answer, None)
    if not (parser.thinks_first or parser.thinks_optionally):
        return None
    end, start = (list(ctx.tokenizer(marker, add_special_tokens=False)["input_ids"]) for marker in (parser.end,
                                                                                                   parser.start))
    if ctx.tokenizer.unk_token_id in end + start:  # (a marker this tokenizer does not know is not the model's)
        return None
    if parser.thinks_first:
        return end, None
    return (end, start[0]) if len(start) == 1 else None
