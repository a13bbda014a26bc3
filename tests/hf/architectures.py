"""Every causal-LM architecture transformers ships, tiny and random, through the engine against HF's own generate.

`classify(model_type)` builds the architecture's tiny model (`architecture_configs.tiny_config`, seeded) in float64
and in float32, each where HF's generate runs in it: float64 so that no argmax tie can hide a difference, float32
because the engine takes other paths there (packed linears, fused norms, compiled kernels). In each it takes HF's
greedy tokens (one prompt at a time) and each step's log-probabilities (HF's full forward over prompt + generated
tokens, log_softmax in float64) as the oracle, serves the same prompts through `paged_hf.wrap` with a small block
size and token budget (chunked prefill, prompts longer than the tiny sliding windows), and says which
`Result.status` the architecture has (the worst over the dtypes that ran):

- `not-a-decoder`: not a decoder-only text model, so the engine need not serve it (see `not_a_decoder`);
- `hf-fails`: HF's own generate fails, or disagrees with HF's own forward, in every dtype: there is no oracle;
- `equal`: the engine's greedy tokens are HF's, every step's top-5 logprobs within 1e-3 of HF's, no block leaked;
- `refused`: `wrap()` raised ValueError or NotImplementedError: a clear refusal;
- `differs`: the engine ran and its tokens or logprobs are not HF's (a silent difference: a bug);
- `error`: anything else went wrong inside wrap or the engine (a crash instead of a refusal: a bug).
"""
from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass

import torch
import transformers.utils.logging as hf_logging
from conftest import assert_no_leak, hf_greedy
from transformers import AutoModelForCausalLM
from transformers.cache_utils import DynamicCache, LinearAttentionCacheLayerMixin
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import paged_hf
from architecture_configs import NUM_SPECIAL_IDS, VOCAB_SIZE, default_config, tiny_config
from paged_hf import SamplingParams

STATUSES = ("equal", "refused", "not-a-decoder", "hf-fails", "differs", "error")
PROMPT_LENGTHS = (19, 5, 11)  # the first crosses every tiny sliding window (8) and takes three prefill chunks
MAX_NEW_TOKENS = 6
TOP_LOGPROBS = 5
TOLERANCE = 1e-3
NEAR_TIE = 1e-5  # HF ranks two tokens within this of each other: either is its greedy token (float32 noise)
DTYPES = {"float64": torch.float64, "float32": torch.float32}
ENGINE_CONFIG = {"num_blocks": 64, "block_size": 4, "max_num_batched_tokens": 8, "max_num_seqs": 4}

#: decoder-only by the config, yet generate is not causal decoding of the prompt (checked by name: no config
#: field says it)
NOT_CAUSAL = {
    "xlm": "XLM's generate appends a mask token every step (an MLM head, causal=False by default)",
    "xlnet": "XLNet's generate appends a dummy token with perm_mask/target_mapping (two-stream attention)",
}


@dataclass(frozen=True)
class Result:
    status: str
    detail: str = ""
    dtype: str = ""  # the dtypes the comparison ran in ("" when it did not run)
    seconds: float = 0.0
    served_by: str = ""  # the engine's code for it beyond the model's own: worker/families/ modules, hybrid/


def architectures() -> list[str]:
    """Every model_type of transformers' causal-LM auto mapping."""
    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def not_a_decoder(model_type: str) -> str | None:
    """Why the architecture is not a decoder-only text model the engine could serve by design, else None.

    The rule, read from the default config: an encoder-decoder family (`is_encoder_decoder`: BART-like decoders,
    Whisper, MusicGen's codebook decoder) needs the encoder's states; an encoder whose config has `is_decoder`
    off and takes cross-attention (the BERT family) is a causal LM only when retrofitted with `is_decoder=True`;
    an assistant (draft) model whose every layer reads a target model's KV is not a model of its own; and
    `NOT_CAUSAL` names the few whose generate is not causal decoding at all.
    """
    config = default_config(model_type)
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder family: the causal-LM class is the decoder half"
    if getattr(config, "is_decoder", None) is False and hasattr(config, "add_cross_attention"):
        return "encoder (is_decoder=False by default): causal only when retrofitted as a decoder"
    text = config.get_text_config()
    if getattr(text, "num_kv_shared_layers", 0) and text.num_kv_shared_layers == text.num_hidden_layers:
        return "draft model: every layer attends the KV of a target model (num_kv_shared_layers == num_hidden_layers)"
    return NOT_CAUSAL.get(model_type)


#: recurrent models whose cache is their own (transformers' cache layout does not show their states)
RECURRENT_MODELS = {"rwkv", "xlstm", "recurrent_gemma", "minimax"}


def is_hybrid(model_type: str) -> bool:
    """A hybrid or recurrent model: its tiny config's transformers cache has linear-attention (recurrent, SSM or
    convolution) layers, or its cache is its own."""
    if model_type in RECURRENT_MODELS:
        return True
    try:
        cache = DynamicCache(config=tiny_config(model_type).get_text_config())
    except Exception:  # noqa: BLE001 - a config transformers cannot lay out has no recurrent layer it knows
        return False
    return any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in cache.layers)


def build(model_type: str, dtype: torch.dtype) -> torch.nn.Module:
    """The tiny model, seeded. MoE experts run as HF's eager loop: torch's grouped_mm has no float64."""
    config = tiny_config(model_type)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, experts_implementation="eager").to(dtype).eval()
    model.generation_config.eos_token_id = None  # random models: stop by length
    return model


def prompts_for(model) -> list[list[int]]:
    vocab = min(VOCAB_SIZE, model.get_input_embeddings().num_embeddings)
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(NUM_SPECIAL_IDS, vocab, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


class OracleDisagrees(Exception):
    """HF's generate picks a token its own full forward does not rank first: HF has no single answer."""


def hf_oracle(model, prompts) -> list[tuple[list[int], torch.Tensor]]:
    """Per prompt: HF's greedy tokens and [MAX_NEW_TOKENS, vocab] float64 logprobs from one full forward."""
    expected = []
    for prompt in prompts:
        tokens = hf_greedy(model, prompt, MAX_NEW_TOKENS)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0]
        start = len(prompt) - 1
        logprobs = logits[start:start + MAX_NEW_TOKENS].double().log_softmax(-1)
        for step, token in enumerate(tokens):
            if not logprobs[step, token] >= logprobs[step].max() - NEAR_TIE:
                raise OracleDisagrees(f"HF's generate and its full forward disagree at step {step} (prompt of "
                                      f"{len(prompt)} tokens): generate picked {token}, forward ranks "
                                      f"{logprobs[step].argmax().item()} first")
        expected.append((tokens, logprobs))
    return expected


def compare_in(model_type: str, dtype: str) -> Result:
    """The architecture's status in one dtype (`hf-fails` when HF has no answer there)."""
    try:
        model = build(model_type, DTYPES[dtype])
        prompts = prompts_for(model)
        expected = hf_oracle(model, prompts)
    except OracleDisagrees as exc:
        return Result("hf-fails", str(exc), dtype)
    except Exception as exc:  # noqa: BLE001 - HF's own failure: no oracle in this dtype
        return Result("hf-fails", f"{type(exc).__name__}: {first_line(exc)}", dtype)
    outputs, generator, refusal = run_engine(model, prompts)
    if refusal is not None:
        return Result(refusal.status, refusal.detail, dtype)
    difference = compare(prompts, expected, outputs)
    if difference is not None and difference.startswith("error: "):
        return Result("error", difference.removeprefix("error: "), dtype)
    if difference is not None:
        return Result("differs", difference, dtype)
    leaked = leak(generator)
    return Result("error", leaked, dtype) if leaked else Result("equal", "", dtype, served_by=served_by(generator))


def served_by(generator) -> str:
    """The family modules (worker/families/) that serve the model, and `hybrid` for recurrent mixers."""
    runner = generator.runner
    mixers = [stand_in for *_, stand_in in runner.recurrent_mixers.sites]
    own_states = ["own_states"] if any(mixer.own_states is not None for mixer in mixers) else []
    return ", ".join([*runner.family_stand_ins.families, *own_states, *(["hybrid"] if mixers else [])])


def combine(results: list[Result]) -> Result:
    """The worst status over the dtypes HF ran in; the detail names its dtype when the dtypes disagree."""
    ran = [result for result in results if result.status != "hf-fails"]
    if not ran:
        return Result("hf-fails", results[-1].detail)
    dtypes = ", ".join(result.dtype for result in ran)
    worst = next(result for status in ("error", "differs", "refused", "equal")
                 for result in ran if result.status == status)
    agree = all(result.status == worst.status for result in ran)
    detail = worst.detail if agree or not worst.detail else f"{worst.dtype}: {worst.detail}"
    return Result(worst.status, detail, dtypes, served_by=next((r.served_by for r in ran if r.served_by), ""))


def run_engine(model, prompts):
    """(outputs, generator, None) or (None, None, Result) when wrap refused or something raised."""
    try:
        paged = paged_hf.wrap(model, **ENGINE_CONFIG)
    except (ValueError, NotImplementedError) as exc:
        return None, None, Result("refused", first_line(exc))
    except Exception as exc:  # noqa: BLE001 - any other exception is the finding
        return None, None, Result("error", f"wrap: {type(exc).__name__}: {first_line(exc)}")
    params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=TOP_LOGPROBS)
    try:
        outputs = paged.generator.generate(prompts, params, use_tqdm=False)
    except Exception as exc:  # noqa: BLE001
        return None, None, Result("error", f"generate: {type(exc).__name__}: {first_line(exc)}")
    return outputs, paged.generator, None


def compare(prompts, expected, outputs) -> str | None:
    """Where the engine first departs from HF (a token, or a top-5 logprob off by more than TOLERANCE), or None."""
    for i, (prompt, (tokens, logprobs), output) in enumerate(zip(prompts, expected, outputs)):
        if output.error:
            return f"error: prompt {i}: {output.error}"
        got = output.outputs[0]
        for step, hf_token in enumerate(tokens):
            where = f"prompt {i} (len {len(prompt)}) step {step}"
            if step >= len(got.token_ids):
                return f"{where}: the engine stopped after {len(got.token_ids)} tokens"
            off = logprob_error(got.logprobs[step], logprobs[step])
            if off == math.inf:
                return f"{where}: NaN logprobs"
            if not off <= TOLERANCE:
                return f"{where}: top-{TOP_LOGPROBS} logprobs off by {off:.2g}"
            if got.token_ids[step] != hf_token:
                if logprobs[step, got.token_ids[step]] >= logprobs[step].max() - NEAR_TIE:
                    break  # a tie HF could have broken either way: the continuations differ from here on
                return f"{where}: token {got.token_ids[step]}, HF {hf_token}"
    return None


def logprob_error(entry: dict[int, float], row: torch.Tensor) -> float:
    """Largest gap between the engine's logprobs and HF's row: at each token the engine names, and between the
    sorted top-k values (so a different top-k set counts, a near-tie does not)."""
    gaps = [abs(value - row[token].item()) for token, value in entry.items()]
    ours = sorted(entry.values(), reverse=True)[:TOP_LOGPROBS]
    gaps += [abs(a - b) for a, b in zip(ours, row.topk(TOP_LOGPROBS).values.tolist())]
    return math.inf if any(math.isnan(gap) for gap in gaps) else max(gaps)


def leak(generator) -> str | None:
    """conftest's `assert_no_leak` as a detail instead of an assertion."""
    try:
        assert_no_leak(generator)
    except AssertionError as exc:
        return f"leak after generate: {first_line(exc)}"
    return None


def first_line(exc: BaseException, limit: int = 200) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:limit]


def classify(model_type: str) -> Result:
    """The architecture's status (see the module docstring), with a one-line detail."""
    start = time.perf_counter()
    with warnings.catch_warnings(), quiet():
        warnings.simplefilter("ignore")
        result = _classify(model_type)
    return Result(result.status, result.detail, result.dtype, round(time.perf_counter() - start, 2),
                  result.served_by)


def _classify(model_type: str) -> Result:
    try:
        reason = not_a_decoder(model_type)
    except Exception as exc:  # noqa: BLE001
        return Result("hf-fails", f"default config: {type(exc).__name__}: {first_line(exc)}")
    if reason:
        return Result("not-a-decoder", reason)
    try:
        tiny_config(model_type)
    except Exception as exc:  # noqa: BLE001
        return Result("hf-fails", f"tiny config: {type(exc).__name__}: {first_line(exc)}")
    return combine([compare_in(model_type, dtype) for dtype in DTYPES])


class quiet:
    """For the duration: transformers' loggers at error level (random models warn a lot) and one intra-op thread
    (tiny matrices: threads only add overhead, and a shared machine's load makes them slow by 10x)."""

    def __enter__(self):
        self.level, self.threads = hf_logging.get_verbosity(), torch.get_num_threads()
        hf_logging.set_verbosity_error()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        hf_logging.set_verbosity(self.level)
        torch.set_num_threads(self.threads)
