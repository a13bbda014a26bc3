"""paged_hf's side of the llama.cpp comparison (:mod:`.peer`): one precision, every stream count, in a fresh process.

As a user runs it: ``paged_hf.LLM(path, dtype=..., quantization=...)`` and ``generate`` with greedy sampling, EOS
ignored. N streams are N prompts of 32 random tokens given at once; the run is timed whole (prefill and decode)
and its tok/s is N x 128 / seconds, as llama-batched-bench's whole run is. Each count: one warm-up run of the same
N (16 new tokens), then three timed runs, the median taken. Every run has prompts of its own, so that no run
finds an earlier one's prompt in the prefix cache (llama.cpp clears its cache between runs too).

Memory: the process's resident set before and after ``LLM(...)``, beside the bytes of the weights as the model
holds them (every parameter and buffer storage once) and of the KV cache: what loading adds beyond the KV cache,
over the weights (the issue's target: no more than 1.1x; the engine's packed and fused copies of the linears
count). "Before" is after the runtime's own baseline: the same architecture at a tiny size loaded the same way
and dropped first (`warm_runtime`: libraries, compiled kernels, the modelling and tokenizer code). The resident
set after every stream count is reported too: past the few-row loops' batch the packed copies are made.

Run as ``python -m paged_hf.bench.peer_paged SPEC.json``; the result (JSON) goes to the spec's ``result_path``.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import tempfile
import time
import traceback

import torch

import paged_hf
from paged_hf.bench.machine import current_rss_bytes, peak_rss_bytes, step_weight_bytes, weight_bytes
from paged_hf.loader.default_model import ensure_default_checkpoint
from paged_hf.utils import cdiv, trim_heap

WARMUP_TOKENS = 16
BLOCK_SIZE = 16


def random_prompts(tokenizer, count: int, length: int, seed: int) -> list[list[int]]:
    """`count` prompts of `length` token ids drawn from the vocabulary's ordinary tokens (no special ones)."""
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(len(vocab), (count, length), generator=generator)
    return [[vocab[i] for i in row] for row in picks.tolist()]


def time_streams(llm, streams: int, prompt_tokens: int, new_tokens: int, rounds: int, seed: int) -> dict:
    """`streams` prompts at once: the warm-up, then `rounds` timed runs -> the median run's seconds and tok/s."""
    tokenizer = llm.get_tokenizer()
    params = paged_hf.SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    warmup = paged_hf.SamplingParams(max_tokens=WARMUP_TOKENS, temperature=0.0, ignore_eos=True)
    llm.generate(random_prompts(tokenizer, streams, prompt_tokens, seed), warmup, use_tqdm=False)
    walls = []
    for number in range(rounds):
        prompts = random_prompts(tokenizer, streams, prompt_tokens, seed + 1 + number)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        walls.append(time.perf_counter() - start)
        counts = {len(output.outputs[0].token_ids) for output in outputs}
        if counts != {new_tokens}:
            raise RuntimeError(f"expected {new_tokens} new tokens per stream, got {sorted(counts)}")
    seconds = statistics.median(walls)
    return {"seconds": seconds, "tokens_per_s": streams * new_tokens / seconds,
            "runs_tokens_per_s": [streams * new_tokens / wall for wall in walls]}


def warm_runtime(spec: dict) -> None:
    """Load the spec's architecture at a tiny size (one layer, two heads of the model's head_dim) with its
    tokenizer, at the spec's precision, generate once, and drop it: what stays is the runtime, not the model."""
    import transformers

    path = spec["model"] or str(ensure_default_checkpoint())
    config = transformers.AutoConfig.from_pretrained(path)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    config.update({"num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
                   "hidden_size": 2 * head_dim, "head_dim": head_dim, "intermediate_size": 4 * head_dim})
    with tempfile.TemporaryDirectory(prefix="paged_hf_bench_runtime_") as folder:
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        transformers.AutoTokenizer.from_pretrained(path).save_pretrained(folder)
        llm = paged_hf.LLM(folder, dtype=spec["dtype"], device="cpu", quantization=spec["quantization"],
                           num_blocks=8, block_size=BLOCK_SIZE)
        params = paged_hf.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        llm.generate([[1, 2, 3]] * 3, params, use_tqdm=False)
        del llm
    gc.collect()
    trim_heap()


def run_spec(spec: dict) -> dict:
    """Load the model once at the spec's precision and time every stream count."""
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    streams, prompt_tokens, new_tokens = spec["streams"], spec["prompt_tokens"], spec["new_tokens"]
    blocks = max(streams) * cdiv(prompt_tokens + new_tokens, BLOCK_SIZE) + 8  # all streams at once, no more
    warm_runtime(spec)
    start, rss_before = time.perf_counter(), current_rss_bytes()
    llm = paged_hf.LLM(spec["model"], dtype=spec["dtype"], device="cpu", quantization=spec["quantization"],
                       num_blocks=blocks, block_size=BLOCK_SIZE)
    load_s = time.perf_counter() - start
    memory = load_memory(llm, current_rss_bytes() - rss_before)
    results = {}
    for count in streams:
        results[str(count)] = time_streams(llm, count, prompt_tokens, new_tokens, spec["rounds"], spec["seed"])
    memory["after_streams_over_weights"] = load_memory(llm, current_rss_bytes() - rss_before)["load_over_weights"]
    return {"streams": results, "load_s": load_s, "step_weight_bytes": step_weight_bytes(llm.paged_model.unwrap()),
            "num_threads": torch.get_num_threads(), "peak_rss_bytes": peak_rss_bytes(), "memory": memory}


def load_memory(llm, load_rss_bytes: int) -> dict:
    """What loading added to the resident set, beside the weights' and the KV cache's bytes."""
    weights = weight_bytes(llm.paged_model.unwrap())
    cache = llm.paged_model.generator.runner.cache
    kv_bytes = sum(t.nbytes for t in [*cache.key_cache, *cache.value_cache])
    return {"weight_bytes": weights, "kv_cache_bytes": kv_bytes, "load_rss_bytes": load_rss_bytes,
            "load_over_weights": (load_rss_bytes - kv_bytes) / weights}


def main(spec_path: str) -> int:
    with open(spec_path) as fh:
        spec = json.load(fh)
    try:
        result = run_spec(spec)
    except Exception as exc:  # reported in the table as this precision's error; the others still run
        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {exc}"}
    with open(spec["result_path"], "w") as fh:
        json.dump(result, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
