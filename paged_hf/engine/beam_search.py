"""Beam search on the paged cache: the engine calls that run it (its params and outputs are faces).

A beam search is one user request whose live beams are ordinary engine sequences (`Request`s sharing its
request_id), scheduled in the same steps as every other request. Each round, once every live beam has its
next-token logits, HF's arithmetic (`beam_scoring.BeamScorer`) picks the next beams; a beam extended by
several of them forks (the children share its blocks by reference count, and the last partial block is
copied only when two of them write into it), a beam extended by none is freed. This is not `n > 1`:
parallel sampling draws n independent sequences, beam search keeps the k most likely ones.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from paged_hf.beam.group import BeamCohort, BeamGroup
from paged_hf.core.request import Request
from paged_hf.core.scheduler import Scheduler
from paged_hf.engine.image_prompts import check_adapter, prompt_and_items
from paged_hf.engine.request_checks import per_prompt
from paged_hf.outputs import BeamSearchOutput
from paged_hf.sampling_params import BeamSearchParams, SamplingParams
from paged_hf.utils import cdiv


# --- the engine calls (ContinuousBatchGenerator.add_beam_request / beam_search delegate here) -----------------
def add_beam_request(generator, prompt, params: BeamSearchParams, adapter: str | None = None,
                     request_id: str | None = None, cohort: BeamCohort | None = None, record: bool = False) -> str:
    """Validate and queue one beam search; its first beam computes the prompt, the others fork from it.
    `cohort` and `record` serve the drop-in's `output_scores` (HF runs a batch until every prompt is done
    and keeps every round's scores)."""
    processed = prompt_and_items(generator, prompt)  # a prompt dict may hold images (and its family's positions)
    prompt_ids = processed.token_ids
    internal = check_beam_request(generator, prompt_ids, params)
    lora = generator.resolve_adapter(adapter)
    check_adapter(generator.runner.vision, lora, processed.items)  # images meet no adapter of the vision encoder
    request_id = generator.new_request_id(request_id)
    first = Request(request_id, 0, list(prompt_ids), internal, adapter, lora=lora,
                    adapter_version=None if lora is None else lora.version)
    first.mm_items = list(processed.items)  # every beam carries them: a preempted beam recomputes its images
    first.mm_positions = processed.positions  # and the prompt's own positions (Qwen-VL's), for its every step
    first.reserved_seats = params.beam_width - 1  # the beams it forks after the prompt have seats waiting
    stop_ids = list(params.stop_token_ids or ())
    if not params.ignore_eos:
        stop_ids += [t for t in generator.info.eos_token_ids if t not in stop_ids]
    group = BeamGroup(request_id, prompt_ids, params, first, stop_ids, generator.tokenizer, cohort, record)
    generator.enqueue(group, first)
    return request_id


def check_beam_request(generator, prompt_ids: list[int], params: BeamSearchParams) -> SamplingParams:
    """ValueError for a beam search the engine cannot hold; -> the SamplingParams its sequences carry."""
    if not isinstance(params, BeamSearchParams):
        raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
    if params.beam_width > generator.config.max_num_seqs:
        raise ValueError(f"beam_width={params.beam_width} is more than max_num_seqs={generator.config.max_num_seqs} "
                         "(every beam runs as one sequence)")
    internal = SamplingParams(max_new_tokens=params.max_tokens, temperature=0, ignore_eos=True)
    generator.check_fits(prompt_ids, internal)
    _check_beams_fit(generator, len(prompt_ids), params)
    return internal


def _check_beams_fit(generator, num_prompt_tokens: int, params: BeamSearchParams) -> None:
    """All beams at full length, sharing only the prompt's full blocks (none without prefix caching, where
    a preempted beam recomputes its prompt alone), must fit in the cache at once."""
    block_size = generator.config.block_size
    per_beam = cdiv(num_prompt_tokens + params.max_tokens, block_size)
    shared = num_prompt_tokens // block_size if generator.block_pool.enable_caching else 0
    needed = shared + params.beam_width * (per_beam - shared)
    if needed > generator.block_pool.num_blocks:
        raise ValueError(f"a beam search of width {params.beam_width} over {num_prompt_tokens} + {params.max_tokens} "
                         f"tokens needs up to {needed} KV blocks but the whole cache has "
                         f"{generator.block_pool.num_blocks}; raise num_blocks/kv_cache_memory")


def beam_search(generator, prompts: Sequence, params, adapters=None, use_tqdm: bool = False) -> list[BeamSearchOutput]:
    """Run beam searches to completion (batched with each other and with any other request in flight);
    outputs in prompt order. On any error the call's requests are aborted."""
    prompts = list(prompts)
    params_list = per_prompt(params, len(prompts), "params")
    adapter_names = per_prompt(adapters, len(prompts), "adapters")
    groups = run_beam_searches(generator, prompts, params_list, adapter_names, use_tqdm)
    return [group.beam_output() for group in groups]


def run_beam_searches(generator, prompts: list, params: list[BeamSearchParams], adapters: list, use_tqdm: bool = False,
                      cohort: BeamCohort | None = None, record: bool = False) -> list[BeamGroup]:
    """Submit one beam search per prompt and step the engine until all ended; -> their groups. Their outputs
    are this call's, not step()'s; on any error (or interrupt) they are aborted."""
    from tqdm.auto import tqdm  # noqa: PLC0415

    groups: list[BeamGroup] = []
    try:
        for prompt, p, adapter in zip(prompts, params, adapters):
            groups.append(generator.groups[add_beam_request(generator, prompt, p, adapter, None, cohort, record)])
            generator.claim(groups[-1])
        with tqdm(total=len(groups), desc="paged_hf beam search", unit="req", disable=not use_tqdm) as bar:
            while not all(group.finished for group in groups):
                num_done = sum(group.finished for group in groups)
                generator.step_for_call()
                bar.update(sum(group.finished for group in groups) - num_done)
        return groups
    finally:
        for group in groups:
            generator.release(group)


def route_beam_rows(groups: dict, scheduler: Scheduler, requests: list[Request], logits: torch.Tensor):
    """Hand this step's logits rows of beam sequences to their searches (each decides its round once all its
    beams are in) -> (the other requests, their logits rows, the beam searches that ended this step).
    `groups`: the engine's unfinished requests by id."""
    beam_rows = [i for i, r in enumerate(requests) if isinstance(groups.get(r.request_id), BeamGroup)]
    if not beam_rows:
        return requests, logits, []
    touched: dict[BeamGroup, None] = {}
    for i in beam_rows:
        group = groups[requests[i].request_id]
        group.deliver(requests[i], logits[i])
        touched[group] = None
    for group in touched:
        if group.ready:
            group.decide(scheduler)
    beam_set = set(beam_rows)
    others = [i for i in range(len(requests)) if i not in beam_set]
    rest = logits[torch.tensor(others, dtype=torch.long, device=logits.device)]  # [num_others, vocab_size]
    return [requests[i] for i in others], rest, [group for group in touched if group.finished]
