"""The engine proves, once per model, that it computes what the model's own forward computes.

A model can run under the engine and still be another model: a layer that attends with its own code, a mask
it builds itself, K/V it changes after caching them, math the kernels leave out. The step's books
(`PagedCache.check_step`) catch what never reaches the paged attention; this probe catches the rest. Two short
sequences go through the real runner in four steps that hold what serving holds (a prompt in chunks, a chunk
with a past, decodes, two requests packed in one row), and every position's logits are compared with the
model's own forward over the same tokens. A model that fails, or raises, is refused with the reason.
"""

from __future__ import annotations

import contextlib

import torch

from paged_hf.core.request import Request
from paged_hf.core.scheduler_output import ScheduledRequest, SchedulerOutput
from paged_hf.sampling_params import SamplingParams
from paged_hf.utils import cdiv
from paged_hf.kernels.quant_linear import QuantizedLinear
from paged_hf.kernels.torch_kernel import TorchKernel
from paged_hf.worker.probes.model_probe import UnsupportedModelError, model_name

#: max |engine - model| over the logits, relative to the largest logit, by the model's dtype: rounding in
#: another order stays far below these; a layer that attends the wrong tokens lands far above them
TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-3, torch.bfloat16: 0.08, torch.float16: 0.02}


def verify_engine(runner) -> None:
    """UnsupportedModelError when the engine's logits are not the model's (or the engine cannot run it)."""
    model = runner.model
    lengths = _probe_lengths(runner)
    if lengths is None:
        return  # a cache too small for even the shortest probe: nothing can be served from it anyway
    generator = torch.Generator().manual_seed(0)
    vocab_size = runner.info.vocab_size
    prompts = [torch.randint(vocab_size // 4, vocab_size, (n,), generator=generator).tolist() for n in lengths]
    try:
        with _without_activation_rounding(model):
            with torch.inference_mode(), runner.recurrent_mixers.uncut_rows:  # each prompt in one piece, as a step
                reference = [_own_forward(model, prompt, runner.info.input_device) for prompt in prompts]
            mismatch = _probe_engine(runner, prompts, reference)
            mixers = runner.recurrent_mixers
            if mismatch is not None and mixers.sites and mixers.whole_chunks:
                mixers.whole_chunks = False  # a mixer whose multi-token path ignores its state: token by token
                mismatch = _probe_engine(runner, prompts, reference)
    except UnsupportedModelError:
        raise
    except Exception as exc:  # noqa: BLE001 - what the engine could not run, named in the refusal
        raise UnsupportedModelError(f"{model_name(model)} cannot be served by the paged engine: "
                                    f"{type(exc).__name__}: {exc}") from exc
    if mismatch is not None:
        raise UnsupportedModelError(mismatch)


@contextlib.contextmanager
def _without_activation_rounding(model: torch.nn.Module):
    """W8A8 linears round each token's activations to int8: a sum in another order (the model's own forward over
    20 or over 40 tokens) then lands on another integer, and 30 layers later the logits differ by ~1 (measured on
    the default model). What the probe checks is the model's structure, so during it such linears keep their
    activations in float (their W8A16 arithmetic); the int8 kernels' exactness is their own tests'."""
    rounding = [module for module in model.modules() if getattr(module, "act_quant", False) is True]
    for module in rounding:
        module.act_quant = False
    try:
        yield
    finally:
        for module in rounding:
            module.act_quant = True


def _probe_engine(runner, prompts: list[list[int]], reference: list[torch.Tensor]) -> str | None:
    """Runs the probe's steps -> what differs from the model's own logits, None when nothing does."""
    requests = _probe_requests(prompts, runner.block_size, runner.cache.states is not None)
    with _unquantized(runner, sum(len(r.block_ids) for r in requests)):
        engine_logits = _run_engine(runner, requests)
    dtype = _rounding_dtype(runner.model, runner.info.dtype)
    for got, expected in zip(engine_logits, reference):
        mismatch = _mismatch(runner.model, dtype, got, expected)
        if mismatch is not None:
            return mismatch
    return None


def _rounding_dtype(model: torch.nn.Module, dtype: torch.dtype) -> torch.dtype:
    """The dtype whose rounding the logits carry: a float64 model's quantized linears sum in float32
    (kernels/quant_linear.py), and the same sums over other batches of rows differ by float32's rounding (seen at
    7e-7 of the largest logit on an AMD EPYC, against float64's tolerance of 6.5e-7)."""
    if dtype == torch.float64 and any(isinstance(module, QuantizedLinear) for module in model.modules()):
        return torch.float32
    return dtype


def _probe_lengths(runner) -> tuple[int, int] | None:
    """A spans three blocks (chunks, a chunk with a past, decodes); B is short. Both fit the cache."""
    block_size, num_blocks = runner.block_size, runner.cache.num_blocks
    longest = 2 * block_size + 3
    max_positions = runner.info.max_positions
    if max_positions:
        longest = min(longest, max_positions)
    while longest >= 6 and cdiv(longest, block_size) + cdiv(5, block_size) > num_blocks:
        longest -= block_size
    return (longest, 5) if longest >= 6 else None


@contextlib.contextmanager
def _unquantized(runner, num_blocks: int):
    """An int8/fp8 cache rounds K/V far beyond the tolerances: the probe, which checks the model's attention
    (the quantized kernels are tested against the torch kernel on their own), runs on a cache in the model's
    dtype with the reference kernel."""
    cache = runner.cache
    if all(scales is None for scales in cache.scales):
        yield
        return
    runner.cache = type(cache)(num_blocks, cache.block_size, cache.attention_layers, runner.info.dtype, TorchKernel(),
                              states=cache.states)
    try:
        yield
    finally:
        runner.cache = cache


def _probe_requests(prompts: list[list[int]], block_size: int, hybrid: bool) -> list[Request]:
    """Blocks from 0 up; a hybrid model's requests take recurrent-state slots 0 and 1."""
    requests, next_block = [], 0
    for i, prompt in enumerate(prompts):
        request = Request(f"paged_hf-probe-{i}", 0, prompt, SamplingParams(max_new_tokens=1), prompt_logprobs={},
                          state_slot=i if hybrid else None)
        num_blocks = cdiv(len(prompt), block_size)
        request.block_ids = list(range(next_block, next_block + num_blocks))
        next_block += num_blocks
        requests.append(request)
    return requests


def _schedule(lengths: list[int]) -> list[list[tuple[int, int]]]:
    """Steps of (request index, new tokens): A in a chunk, a chunk with a past, then decodes; B packed beside
    it, first as a fresh prompt, then a one-token step, then a short chunk with a past."""
    a, b = lengths
    first = a // 2
    steps = [[(0, first), (1, 2)], [(0, a - 2 - first), (1, 1)], [(0, 1), (1, b - 3)], [(0, 1)]]
    return [[(i, n) for i, n in step if n > 0] for step in steps]


@torch.inference_mode()
def _run_engine(runner, requests: list[Request]) -> list[torch.Tensor]:
    """-> per request, its logits at every position [num_tokens, vocab_size], from the engine's steps."""
    rows: list[list[torch.Tensor]] = [[] for _ in requests]
    for step in _schedule([r.num_tokens for r in requests]):
        out = SchedulerOutput(scheduled=[ScheduledRequest(requests[i], n) for i, n in step])
        logits, _ = runner.run(out)  # every computed position's row, request by request
        start = 0
        for i, n in step:
            rows[i].append(logits[start:start + n].float())
            start += n
            requests[i].num_computed_tokens += n
    return [torch.cat(r) for r in rows]


def _own_forward(model: torch.nn.Module, prompt: list[int], device: torch.device) -> torch.Tensor:
    output = model(input_ids=torch.tensor([prompt], device=device), use_cache=False)
    return output.logits[0].float()  # [num_tokens, vocab_size]


def _mismatch(model, dtype: torch.dtype, got: torch.Tensor, expected: torch.Tensor) -> str | None:
    expected = expected.to(got.device)
    error = (got - expected).abs().amax(dim=-1)  # [num_tokens]
    scale = expected.abs().amax().clamp_min(1e-6)
    tolerance = TOLERANCE.get(dtype, 0.08) * scale
    if not bool(torch.isfinite(got).all()) or bool((error > tolerance).any()):
        position = int(error.argmax())
        return (f"{model_name(model)}: the paged engine's logits differ from the model's own forward (position "
                f"{position}: max |difference| {float(error[position]):.3g}, largest logit {float(scale):.3g}); "
                "some module computes what the paged attention does not (attention code, masks or K/V of its own)")
    return None
