"""`PagedModel.generate`: HF's `generate` arguments in, HF's return value out, the paged engine in between.

Arguments are read with HF's own helpers (`_prepare_generation_config`, `_prepare_special_tokens`, ...), so
defaults, precedence and warnings are those of the installed transformers. What the engine cannot reproduce
token for token goes to the model's own `generate`, unchanged, with a one-time warning: the drop-in must
never fail, nor answer differently, where HF works.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import itertools
from dataclasses import dataclass

import torch
from transformers.generation import GenerationConfig, GenerationMixin, logits_process
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.stopping_criteria import StopStringCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.utils import logging

from paged_hf.engine.beam_search import check_beam_request
from paged_hf.hf import beam_generate as hf_beam_generate
from paged_hf.sampling_params import BeamSearchParams, SamplingParams

logger = logging.get_logger(__name__)

_GENERATE_SIGNATURE = inspect.signature(GenerationMixin.generate)
_SERVED_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE, GenerationMode.BEAM_SEARCH)
# Generation options the engine has no processor for: unsupported when set at all, or when not at an "off" value.
_OPTIONS_SET = ("bad_words_ids", "forced_bos_token_id", "forced_eos_token_id", "exponential_decay_length_penalty",
                "suppress_tokens", "begin_suppress_tokens", "watermarking_config", "max_time", "sequence_bias")
_OPTIONS_OFF = {"guidance_scale": (None, 1), "encoder_repetition_penalty": (None, 1), "no_repeat_ngram_size": (None, 0),
                "encoder_no_repeat_ngram_size": (None, 0), "remove_invalid_values": (None, False),
                "renormalize_logits": (None, False), "token_healing": (None, False), "is_assistant": (None, False)}
_UNSUPPORTED_ARGS = ("prefix_allowed_tokens_fn", "assistant_model", "negative_prompt_ids", "custom_generate",
                     "negative_prompt_attention_mask", "assistant_tokenizer", "inputs_embeds")
_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")


@dataclass
class _Call:
    """One `generate` call, translated: what the engine runs and what the output is rebuilt from."""

    input_ids: torch.Tensor  # [batch, seq], exactly as given (padding included)
    prompts: list[list[int]]  # per input row, its padding removed
    config: GenerationConfig  # merged as HF merges it
    params: SamplingParams  # params.n = num_return_sequences
    pad_token_id: int | None
    streamer: object | None = None
    stop_criteria: StopStringCriteria | None = None
    beam: BeamSearchParams | None = None  # num_beams > 1: HF's beam search


class _Fallback(Exception):
    """Raised while translating a call: the reason the engine cannot serve it."""


def paged_generate(paged_model, *args, **kwargs):
    """Serve `model.generate(*args, **kwargs)` with the engine, or fall back to the model's own `generate`."""
    try:
        call = _translate(paged_model, args, kwargs)
    except _Fallback as reason:
        logger.warning_once(f"paged_hf: generate() falls back to the model's own generate: {reason}")
        return paged_model.unwrap().generate(*args, **kwargs)
    if call.beam is not None:
        return hf_beam_generate.generate_beams(paged_model.generator, call)
    sequences = _assemble(call, _run(paged_model.generator, call))
    if call.config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences


def _translate(paged_model, args: tuple, kwargs: dict) -> _Call:
    """Read the call the way HF's `generate` does; raise `_Fallback` for anything the engine cannot match.
    An error from HF's own helpers also falls back, so that HF raises (or handles) it exactly as it would."""
    model = paged_model.unwrap()
    if type(model).generate is not GenerationMixin.generate or model.config.is_encoder_decoder:
        raise _Fallback(f"{type(model).__name__} is an encoder-decoder model or overrides generate()")
    try:
        named = dict(_GENERATE_SIGNATURE.bind(model, *args, **kwargs).arguments)
        extra = dict(named.pop("kwargs", {}))
        input_ids, attention_mask, tokenizer = _pop_inputs(named, extra)
        config, model_inputs = _merged_config(model, named.get("generation_config"), extra, input_ids, attention_mask)
        mask = _prompt_mask(model, config, input_ids, attention_mask)
        params = _sampling_params(config, input_ids.shape[1])
        if params.repetition_penalty != 1.0 and not bool(mask.all()):
            raise _Fallback("repetition_penalty on a padded batch (HF penalizes the pad tokens too)")
        beam = hf_beam_generate.beam_params(config, params) if config.num_beams > 1 else None
        criteria = _stop_criteria(config, tokenizer, input_ids.shape[0] * params.n)
        prompts = [row[row_mask].tolist() for row, row_mask in zip(input_ids.cpu(), mask)]
        generator = paged_model.generator
        for prompt in prompts:  # the engine's own limits (vocabulary, max_model_len, cache size): HF has none
            generator.check_fits(generator.prompt_token_ids(prompt), params)
            if beam is not None:
                check_beam_request(generator, prompt, beam)
        prompts = _with_images(generator, prompts, model_inputs)
    except _Fallback:
        raise
    except Exception as error:  # noqa: BLE001 - HF refuses the call, or the engine would: let HF answer
        raise _Fallback(f"{type(error).__name__}: {error}") from None
    streamer = named.get("streamer")
    if streamer is not None and (input_ids.shape[0] * params.n != 1 or beam is not None):
        raise _Fallback("a streamer with more than one sequence, or with beam search")
    pad = None if config._pad_token_tensor is None else int(config._pad_token_tensor)
    return _Call(input_ids, prompts, config, params, pad, streamer, criteria, beam)


def _with_images(generator, prompts: list[list[int]], model_inputs: dict) -> list:
    """The prompts, with a processor's image inputs (`pixel_values`, ...) as the engine's image items; `_Fallback`
    for other model inputs, or images the engine cannot take from this call."""
    if not model_inputs:
        return prompts
    if generator.prompt_processor is None or "pixel_values" not in model_inputs:
        raise _Fallback(f"unsupported argument(s) {sorted(model_inputs)}"
                        + ("" if generator.prompt_processor is None else " (images go in pixel_values)"))
    if len(prompts) != 1:
        raise _Fallback("images in a batch of several prompts (one prompt with its images is served)")
    return [generator.prompt_processor.from_model_inputs(prompts[0], model_inputs)]


def _pop_inputs(named: dict, extra: dict) -> tuple[torch.Tensor, torch.Tensor | None, object]:
    """The prompt, its mask and the tokenizer; every `generate` argument outside the served set falls back."""
    unsupported = [name for name in _UNSUPPORTED_ARGS if named.get(name) is not None or extra.get(name) is not None]
    unsupported += [name for name in ("logits_processor", "stopping_criteria", "synced_gpus") if named.get(name)]
    if unsupported or extra.get("cache_implementation") == "paged":
        raise _Fallback(f"unsupported argument(s) {unsupported or ['cache_implementation=paged']}")
    extra.pop("trust_remote_code", None)
    input_ids = named["inputs"] if named.get("inputs") is not None else extra.pop("input_ids", None)
    if extra.get("input_ids") is not None:
        raise _Fallback("both `inputs` and `input_ids`")
    if not (isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and input_ids.numel() > 0
            and not input_ids.is_floating_point() and input_ids.dtype != torch.bool):
        raise _Fallback("`input_ids` missing or not a [batch, seq] integer tensor")
    return input_ids, extra.pop("attention_mask", None), extra.pop("tokenizer", None)


def _merged_config(model, given, extra: dict, input_ids: torch.Tensor, attention_mask) -> tuple[GenerationConfig, dict]:
    """kwargs > given `generation_config` > the model's > HF's global defaults, via HF's own code, then the
    special tokens and lengths exactly as `generate` prepares them (its warnings included). -> (the config, the
    model inputs beside the prompt: a processor's `pixel_values`, ...)."""
    has_default_max_length = extra.get("max_length") is None and (given is None or given.max_length is None) \
        and model.generation_config.max_length is None
    has_default_min_length = extra.get("min_length") is None and (given is None or given.min_length is None) \
        and model.generation_config.min_length is None
    config, model_kwargs = model._prepare_generation_config(given, **extra)
    model_kwargs = {k: v for k, v in model_kwargs.items()
                    if v is not None and k not in ("output_attentions", "output_hidden_states")}
    mode = config.get_generation_mode()
    supported = getattr(model, "_supported_generation_modes", None)
    if mode not in _SERVED_MODES or (supported is not None and mode not in supported):
        raise _Fallback(f"generation mode {mode}")
    _check_config(config)
    model._prepare_special_tokens(config, attention_mask is not None, device=input_ids.device,
                                  batch_size=input_ids.shape[0])
    config = model._prepare_generated_length(config, has_default_max_length, has_default_min_length,
                                             "input_ids", input_ids.shape[1], input_ids)
    model._validate_generated_length(config, input_ids.shape[1], has_default_max_length)
    return config, model_kwargs


def _check_config(config: GenerationConfig) -> None:
    """Every generation option that adds an HF logits processor or stopping criterion the engine lacks."""
    def get(name):
        return getattr(config, name, None)

    names = [name for name in _OPTIONS_SET if get(name) is not None]
    names += [name for name, off in _OPTIONS_OFF.items() if get(name) not in off]
    if config.do_sample:  # the sampling-only warpers (HF ignores them when greedy)
        names += ["top_h"] if get("top_h") is not None else []
        names += ["typical_p"] if get("typical_p") is not None and get("typical_p") < 1.0 else []
        names += [name for name in ("epsilon_cutoff", "eta_cutoff") if get(name) is not None and 0 < get(name) < 1]
    if config.return_dict_in_generate:  # the engine keeps no states, and scores or logits in beam search only
        kept = ("output_scores", "output_logits") if (config.num_beams or 1) > 1 else ()
        names += [name for name in _OUTPUTS if get(name) and name not in kept]
    if names:
        raise _Fallback(f"unsupported generation option(s) {names}")


def _prompt_mask(model, config: GenerationConfig, input_ids: torch.Tensor, attention_mask) -> torch.Tensor:
    """[batch, seq] bool: the prompt positions of each row. Without a mask HF infers one from pad_token_id.
    Only left padding is served: a right-padded row's first token comes from a pad position in HF, which a
    stripped prompt cannot reproduce."""
    if attention_mask is None:
        if "attention_mask" not in inspect.signature(model.forward).parameters:
            return torch.ones_like(input_ids, dtype=torch.bool)
        attention_mask = model._prepare_attention_mask_for_generation(input_ids, config, {})
    if not (isinstance(attention_mask, torch.Tensor) and attention_mask.shape == input_ids.shape
            and ((attention_mask == 0) | (attention_mask == 1)).all()):
        raise _Fallback("an attention_mask that is not a [batch, seq] tensor of 0s and 1s")
    mask = attention_mask.bool().cpu()
    if not (mask[:, -1].all() and (mask[:, 1:] >= mask[:, :-1]).all()):
        raise _Fallback("padding that is not left padding")
    return mask


def _sampling_params(config: GenerationConfig, input_length: int) -> SamplingParams:
    """HF's length and sampling settings as SamplingParams. EOS is HF's exact set: `ignore_eos` drops the
    engine's own EOS (the model's, read at wrap time) and `stop_token_ids` carries HF's."""
    eos = [] if config._eos_token_tensor is None else [int(t) for t in config._eos_token_tensor.reshape(-1)]
    max_new_tokens = config.max_length - input_length  # HF's max_length/min_length count the padded input
    min_new_tokens = max(0, (config.min_length or 0) - input_length) if eos else 0  # only EOS is ever masked
    sample = bool(config.do_sample)
    top_k = config.top_k or 0
    temperature, top_p, penalty = (1.0 if value is None else value  # None: the processor is not applied
                                   for value in (config.temperature, config.top_p, config.repetition_penalty))
    # HF's processors validate their values; building them makes the engine refuse what HF refuses.
    checks = [(sample and temperature != 1.0, "TemperatureLogitsWarper", temperature),
              (sample and top_k, "TopKLogitsWarper", top_k), (sample and top_p < 1.0, "TopPLogitsWarper", top_p),
              (sample and config.min_p is not None, "MinPLogitsWarper", config.min_p),
              (penalty != 1.0, "RepetitionPenaltyLogitsProcessor", penalty)]
    for applies, processor, value in checks:
        if applies:
            getattr(logits_process, processor)(value)
    return SamplingParams(
        max_new_tokens=max_new_tokens, min_new_tokens=min(min_new_tokens, max_new_tokens),
        temperature=float(temperature) if sample else 0.0, top_k=top_k if sample else 0,
        top_p=float(top_p) if sample else 1.0, min_p=float(config.min_p or 0.0) if sample else 0.0,
        repetition_penalty=float(penalty), n=config.num_return_sequences or 1,
        ignore_eos=True, stop_token_ids=eos or None,
    )


def _stop_criteria(config: GenerationConfig, tokenizer, num_sequences: int) -> StopStringCriteria | None:
    """HF's own StopStringCriteria, so a stop string ends a row at exactly the token where it ends it in HF."""
    if config.stop_strings is None:
        return None
    if tokenizer is None or (config._eos_token_tensor is None and num_sequences > 1):
        # HF raises without a tokenizer; without EOS it keeps generating real tokens (not pads) for rows that
        # hit a stop string while others run on
        raise _Fallback("stop_strings without `tokenizer=`, or in a batch without eos_token_id")
    return StopStringCriteria(tokenizer=tokenizer, stop_strings=config.stop_strings)


# --- running and the output tensor -------------------------------------------------------------------
def _run(generator, call: _Call) -> list[list[int]]:
    """The generated tokens of every output row, in HF's order (each prompt's sequences contiguous)."""
    if call.streamer is not None:
        return [_run_streamed(generator, call)]
    if call.stop_criteria is not None:
        return _run_with_stop_strings(generator, call)
    outputs = generator.generate(call.prompts, [call.params] * len(call.prompts), use_tqdm=False)
    return [completion.token_ids for output in outputs for completion in output.outputs]


def _run_streamed(generator, call: _Call) -> list[int]:
    """One sequence, streamed as HF streams: the prompt, then each new token as a [1] tensor, then end()."""
    call.streamer.put(call.input_ids.cpu())
    tokens: list[int] = []
    with contextlib.closing(generator.stream(call.prompts[0], call.params)) as stream:
        for token in itertools.chain.from_iterable(stream):
            tokens.append(token)
            call.streamer.put(torch.tensor([token]))
            if call.stop_criteria is not None and _first_stop(call, 0, tokens, len(tokens) - 1) is not None:
                break  # closing the stream aborts the request and frees its blocks
    call.streamer.end()
    return tokens


def _run_with_stop_strings(generator, call: _Call) -> list[list[int]]:
    """One n=1 request per output row, stepped by hand: a row is cut and aborted at the first token where
    HF's StopStringCriteria fires (on the padded input row + tokens, as in HF), never later."""
    single = dataclasses.replace(call.params, n=1)
    rows: dict[str, int] = {}
    results: dict[int, list[int]] = {}
    num_checked: dict[int, int] = {}
    try:
        for row in range(len(call.prompts) * call.params.n):
            rows[generator.add_request(call.prompts[row // call.params.n], single)] = row
        while len(results) < len(rows):
            for output in generator.step():
                row = rows.get(output.request_id)
                if row is None or row in results:
                    continue
                tokens = output.outputs[0].token_ids
                stop = _first_stop(call, row, tokens, num_checked.get(row, 0))
                num_checked[row] = len(tokens)
                if stop is not None:
                    results[row] = tokens[: stop + 1]
                    generator.abort(output.request_id)  # no-op when it already finished
                elif output.finished:
                    results[row] = tokens
    except BaseException:
        for request_id in rows:
            generator.abort(request_id)
        raise
    finally:
        _deliver_aborts(generator)
    return [results[row] for row in range(len(rows))]


def _deliver_aborts(generator) -> None:
    """An aborted request's final output waits for the next step; take that step when nothing else is in
    flight (it runs no model then), so the generator is left with no pending request."""
    stats = generator.stats()
    if generator.has_unfinished_requests() and not (stats["num_running"] or stats["num_waiting"]):
        generator.step()


def _first_stop(call: _Call, row: int, tokens: list[int], start: int) -> int | None:
    """Index of the first token at or after `start` after which HF's stop-string criterion fires."""
    prefix = call.input_ids[row // call.params.n].tolist()
    for index in range(start, len(tokens)):
        if call.stop_criteria(torch.tensor([prefix + tokens[: index + 1]]), None)[0]:
            return index
    return None


def _assemble(call: _Call, rows: list[list[int]]) -> torch.Tensor:
    """[batch * n, seq + longest] as HF builds it: the input rows as given, then the generated tokens, rows
    that finished early filled with pad_token_id (HF appends pad after a row's EOS until all rows end)."""
    width = max(len(tokens) for tokens in rows)
    assert call.pad_token_id is not None or all(len(tokens) == width for tokens in rows), "ragged rows, no pad"
    generated = torch.full((len(rows), width), call.pad_token_id or 0, dtype=torch.long)  # [batch * n, width]
    for i, tokens in enumerate(rows):
        generated[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    inputs = call.input_ids.repeat_interleave(call.params.n, dim=0).long()  # [batch * n, seq]
    return torch.cat([inputs, generated.to(inputs.device)], dim=1)
