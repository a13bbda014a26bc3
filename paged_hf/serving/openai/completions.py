"""/v1/completions answers: batched prompts (OpenAI's choice indexing), `echo`, and vLLM's prompt logprobs.

A request with several prompts is one engine request per prompt; choice `i * n + j` is sequence j of prompt i
(as OpenAI and vLLM number them). With `echo` each choice's text and logprobs start with its prompt:
`token_logprobs[0]` and `top_logprobs[0]` are null (nothing predicts the first token).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from paged_hf.serving.openai.logprobs import completion_logprobs, token_text
from paged_hf.serving.openai.protocol import CompletionChoice, CompletionLogprobs, PromptLogprob
from paged_hf.serving.openai.serving import Prepared


def completion_choices(ctx, prepared: Prepared, finals: list) -> list[CompletionChoice]:
    """The choices of a finished request: `finals[i]` is the final RequestOutput of prompt i."""
    k = prepared.params.logprobs
    n = prepared.params.n
    choices = []
    for i, output in enumerate(finals):
        prompt_entries = prompt_logprob_entries(ctx.tokenizer, output.prompt_logprobs)
        echo_prompt = None  # the prompt's part of echo's logprobs: decoded once, shared by the n choices
        if prepared.echo and k is not None:
            echo_prompt = _echo_logprobs(ctx.tokenizer, output, k)
        for c in output.outputs:
            token_ids, entries, text = c.token_ids, c.logprobs or [], c.text or ""
            if prepared.echo_only:
                token_ids, entries, text = [], [], ""
            logprobs = None
            if prepared.echo:
                prompt_text = echo_text(ctx.tokenizer, prepared, i)
                if k is not None:
                    logprobs = _joined(echo_prompt, completion_logprobs(ctx.tokenizer, token_ids, entries, k, 0))
                text = prompt_text + text
            elif k is not None:
                logprobs = completion_logprobs(ctx.tokenizer, token_ids, entries, k, 0)
            finish = "length" if prepared.echo_only else c.finish_reason
            choices.append(CompletionChoice(index=i * n + c.index, text=text, logprobs=logprobs, finish_reason=finish,
                                            stop_reason=None if prepared.echo_only else c.stop_reason,
                                            prompt_logprobs=prompt_entries))
    return choices


def echo_text(tokenizer, prepared: Prepared, index: int) -> str:
    """The prompt as sent; token ids are decoded (special tokens kept, as they are in the prompt)."""
    text = prepared.prompt_texts[index] if index < len(prepared.prompt_texts) else None
    if text is not None:
        return text
    ids = prepared.prompts[index]
    return tokenizer.decode(ids) if tokenizer is not None else ""


def _echo_logprobs(tokenizer, output, k: int) -> CompletionLogprobs:
    """The prompt tokens' part of echo's logprobs (nothing predicts the first: null)."""
    prompt_ids = output.prompt_token_ids
    prompt_entries = [entry or {} for entry in output.prompt_logprobs or [None] * len(prompt_ids)]
    result = completion_logprobs(tokenizer, prompt_ids, prompt_entries, k, 0)
    result.token_logprobs[0] = None
    result.top_logprobs[0] = None
    return result


def _joined(prompt: CompletionLogprobs, generated: CompletionLogprobs) -> CompletionLogprobs:
    """Prompt tokens, then generated ones, in one list: OpenAI's shape for echo with logprobs."""
    end = (prompt.text_offset[-1] + len(prompt.tokens[-1])) if prompt.tokens else 0
    return CompletionLogprobs(tokens=prompt.tokens + generated.tokens,
                              token_logprobs=prompt.token_logprobs + generated.token_logprobs,
                              top_logprobs=prompt.top_logprobs + generated.top_logprobs,
                              text_offset=prompt.text_offset + [end + offset for offset in generated.text_offset])


def prompt_logprob_entries(tokenizer, entries) -> list[dict[int, PromptLogprob] | None] | None:
    """vLLM's `prompt_logprobs` field: per prompt position {token_id: {logprob, decoded_token}}, first null."""
    if entries is None:
        return None
    return [None if entry is None else
            {t: PromptLogprob(logprob=lp, decoded_token=token_text(tokenizer, t)) for t, lp in entry.items()}
            for entry in entries]


async def last_output(source: AsyncIterator):
    final = None
    async for output in source:
        final = output
    return final


async def merged(sources: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """(prompt index, output) from every prompt's source, as they come. Leaving early cancels the rest (so each
    source's own cleanup aborts its engine request); an error of one source ends the whole stream."""
    if len(sources) == 1:
        async for output in sources[0]:
            yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, source: AsyncIterator) -> None:
        try:
            async for output in source:
                await queue.put((index, output))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((index, exc))
        finally:
            await queue.put((index, done))

    tasks = [asyncio.create_task(pump(i, source)) for i, source in enumerate(sources)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
