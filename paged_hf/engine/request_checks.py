"""What `ContinuousBatchGenerator` checks about a request before anything is queued: a bad prompt or sampling
field is a ValueError that names it (the server turns it into a 400), never a failure in the middle of a step."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from paged_hf.sampling_params import SamplingParams
from paged_hf.utils import cdiv


def prompt_token_ids(prompt, tokenizer, vocab_size: int) -> list[int]:
    """A text prompt (tokenized, special tokens added), a list of token ids or a 1-D tensor -> token ids."""
    if isinstance(prompt, Mapping):
        raise ValueError("a prompt dict (prompt, prompt_token_ids, multi_modal_data) is served by generate(), "
                         "beam_search(), add_request() and stream() only")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer: pass tokenizer= to wrap() or give token ids")
        prompt = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    if isinstance(prompt, torch.Tensor):
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise ValueError("a prompt must be a string or a list of token ids")
    if not prompt:
        raise ValueError("the prompt is empty")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return list(prompt)


def check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """logit_bias, allowed_token_ids and the thinking's markers name token ids: one outside the vocabulary is a
    mistake, not a no-op."""
    for name in ("logit_bias", "allowed_token_ids", "thinking_end_token_ids", "thinking_start_token_id"):
        value = getattr(params, name)
        bad = [t for t in ([value] if isinstance(value, int) else value or ()) if t >= vocab_size]
        if bad:
            raise ValueError(f"{name}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")


def check_fits(prompt_ids: list[int], params: SamplingParams, max_model_len: int, block_size: int,
               num_blocks: int) -> None:
    """The whole request (prompt + max_new_tokens) fits the model's length and the cache."""
    total = len(prompt_ids) + params.max_new_tokens
    if total > max_model_len:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) = {total} "
                         f"is longer than max_model_len={max_model_len}")
    needed = cdiv(total, block_size)
    if needed > num_blocks:
        raise ValueError(f"a request of {total} tokens needs {needed} KV blocks but the whole cache has "
                         f"{num_blocks}; raise num_blocks/kv_cache_memory")


def prompt_list(prompts) -> list:
    """generate()'s prompts: one prompt (a string, a list of token ids, a 1-D tensor) or a sequence of them."""
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if isinstance(prompts, torch.Tensor):
        return [prompts] if prompts.dim() == 1 else list(prompts)
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]
    return prompts


def per_prompt(value, count: int, name: str) -> list:
    """A value for every prompt: one given for all, or a list with one per prompt."""
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} entries for {count} prompts")
        return list(value)
    return [value] * count
