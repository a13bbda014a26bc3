"""The drop-in `generate(num_beams=k)`: HF's beam-search arguments in, HF's beam-search output out.

`hf_generate` reads the call; this module turns its settings into `BeamSearchParams`, runs one beam search
per prompt on the engine, and rebuilds what HF's `_beam_search` returns: the best `num_return_sequences`
rows per prompt, filled after EOS with HF's fill value, and with `return_dict_in_generate` the
`beam_indices`, `sequences_scores`, and per-round `scores` / `logits`.
"""

from __future__ import annotations

import torch
from transformers.generation import GenerationConfig
from transformers.generation.utils import GenerateBeamDecoderOnlyOutput

from paged_hf.beam.group import BeamCohort, BeamGroup
from paged_hf.engine.beam_search import run_beam_searches
from paged_hf.sampling_params import BeamSearchParams, SamplingParams


def beam_params(config: GenerationConfig, params: SamplingParams) -> BeamSearchParams:
    """HF's beam-search settings; ValueError (the caller falls back to HF) for what the engine lacks."""
    if config.stop_strings is not None:
        raise ValueError("stop_strings with beam search")
    if config.low_memory:
        raise ValueError("low_memory beam search")  # HF refuses it: let HF say so
    return BeamSearchParams(
        beam_width=config.num_beams, max_tokens=params.max_new_tokens, min_tokens=params.min_new_tokens,
        length_penalty=config.length_penalty, early_stopping=config.early_stopping,
        num_return_sequences=config.num_return_sequences or 1, ignore_eos=True,
        stop_token_ids=params.stop_token_ids, repetition_penalty=params.repetition_penalty,
    )


def generate_beams(generator, call):
    """Run the call's beam searches on the engine -> HF's `sequences` tensor or GenerateBeamDecoderOnlyOutput."""
    config = call.config
    record = bool(config.return_dict_in_generate and (config.output_scores or config.output_logits))
    cohort = BeamCohort() if record else None  # per-round outputs: every prompt runs as long as HF's batch
    groups = run_beam_searches(generator, call.prompts, [call.beam] * len(call.prompts), [None] * len(call.prompts),
                               cohort=cohort, record=record)
    sequences, beam_indices, scores = _rows(call, groups)
    if not config.return_dict_in_generate:
        return sequences
    num_rounds = cohort.num_rounds if cohort is not None else 0
    device = call.input_ids.device

    def per_round(name):
        return tuple(torch.cat([getattr(g, name)[r] for g in groups]).to(device) for r in range(num_rounds))

    return GenerateBeamDecoderOnlyOutput(
        sequences=sequences,
        sequences_scores=scores if config.output_scores else None,
        scores=per_round("log_probs_per_round") if config.output_scores else None,
        logits=per_round("logits_per_round") if config.output_logits else None,
        beam_indices=beam_indices,
    )


def _rows(call, groups: list[BeamGroup]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> sequences [batch * nrs, seq + longest], beam_indices [batch * nrs, longest] (int32, -1 after the
    end) and sequences_scores [batch * nrs] (float32), each prompt's best hypotheses first."""
    width = call.beam.beam_width
    hypotheses = [(b, h) for b, group in enumerate(groups) for h in group.hypotheses()]
    longest = max(len(h.token_ids) for _, h in hypotheses)
    eos = call.params.stop_token_ids
    # HF's `pad_token_id or eos_token_id[0] if eos_token_id is not None else -1` (a pad id of 0 fills with EOS)
    fill = (call.pad_token_id or eos[0]) if eos else -1
    generated = torch.full((len(hypotheses), longest), fill, dtype=torch.long)
    beam_indices = torch.full((len(hypotheses), longest), -1, dtype=torch.int32)
    for i, (b, h) in enumerate(hypotheses):
        generated[i, : len(h.token_ids)] = torch.tensor(h.token_ids, dtype=torch.long)
        beam_indices[i, : len(h.token_ids)] = torch.tensor([b * width + j for j in h.beam_indices], dtype=torch.int32)
    device = call.input_ids.device
    inputs = call.input_ids.repeat_interleave(call.beam.num_return_sequences, dim=0).long()  # [batch * nrs, seq]
    sequences = torch.cat([inputs, generated.to(device)], dim=1)
    scores = torch.tensor([h.score for _, h in hypotheses], dtype=torch.float32, device=device)
    return sequences, beam_indices.to(device), scores
