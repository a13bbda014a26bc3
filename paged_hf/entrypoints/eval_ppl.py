"""Perplexity through the engine (`paged-hf eval-ppl`): what a quantized KV cache costs, measured, not assumed.

The text is cut into windows of `context_len` tokens whose ends are `stride` apart (HF's strided recipe): each
window scores only the tokens the previous one did not (at most `stride`), with the rest as context, so every
token after the first is scored once, and each with at least context_len - stride tokens before it. The engine computes the windows' prompt logprobs in its paged prefill (chunked, and reading the cache
back in the cache's dtype), all windows batched; plain HF computes the same numbers with one forward per
window, as the reference for the model's own dtype.
"""

from __future__ import annotations

import gc
import importlib
import inspect
import json
import math
import warnings
from dataclasses import dataclass

import torch

from paged_hf.config import PagedConfig
from paged_hf.engine.generator import ContinuousBatchGenerator
from paged_hf.entrypoints.cli_args import add_engine_args, add_model_args, engine_config
from paged_hf.loader import default_model
from paged_hf.loader.quantized import describe_linears, quantize_model
from paged_hf.sampling_params import SamplingParams
from paged_hf.utils import cdiv

#: The built-in corpus: the docstrings of these standard-library modules (and their classes and functions), in
#: this order. They change a little between Python versions: compare numbers from one interpreter.
CORPUS_MODULES = (
    "argparse", "asyncio", "collections", "contextlib", "csv", "dataclasses", "datetime", "decimal", "difflib",
    "email.message", "enum", "fractions", "functools", "heapq", "http.client", "inspect", "ipaddress", "itertools",
    "json", "logging", "os", "pathlib", "pickle", "pprint", "random", "re", "shutil", "socket", "sqlite3", "ssl",
    "statistics", "string", "subprocess", "tarfile", "textwrap", "threading", "typing", "unittest", "urllib.parse",
    "urllib.request", "uuid", "zipfile",
)


@dataclass
class Window:
    begin: int  # the window's tokens are ids[begin:end]
    end: int
    num_scored: int  # its last num_scored tokens are scored


def stdlib_docstrings() -> str:
    """The built-in corpus (~1 MB of English prose about code)."""
    parts: list[str] = []
    with warnings.catch_warnings():  # some attributes are deprecated aliases (typing.io) that warn when read
        warnings.simplefilter("ignore", DeprecationWarning)
        for name in CORPUS_MODULES:
            module = importlib.import_module(name)
            objects = [module] + [obj for _, obj in sorted(vars(module).items())
                                  if (inspect.isclass(obj) or inspect.isfunction(obj)) and
                                  getattr(obj, "__module__", None) == module.__name__]
            parts += [doc for doc in (inspect.getdoc(obj) for obj in objects) if doc]
    return "\n\n".join(parts)


def windows(num_tokens: int, context_len: int, stride: int) -> list[Window]:
    """Every token but the first is scored exactly once. A window's first token has nothing before it in that
    window, so a stride must leave at least one token of overlap: stride < context_len."""
    if not (isinstance(context_len, int) and context_len >= 2):
        raise ValueError(f"context_len must be an int >= 2, got {context_len!r}")
    if not (isinstance(stride, int) and 1 <= stride < context_len):
        raise ValueError(f"stride must be an int in [1, context_len={context_len}), got {stride!r}")
    if num_tokens < 2:
        raise ValueError(f"the text has {num_tokens} token(s); perplexity needs at least 2")
    end = min(context_len, num_tokens)
    result = [Window(0, end, end - 1)]  # token 0 has nothing before it
    while end < num_tokens:
        scored_from, end = end, min(end + stride, num_tokens)
        result.append(Window(max(0, end - context_len), end, end - scored_from))
    return result


def engine_nll(generator, ids: list[int], spans: list[Window]) -> tuple[float, int]:
    """(sum of -log p, tokens scored) from the engine's prompt logprobs, every window in one generate call."""
    params = SamplingParams(max_new_tokens=1, temperature=0, prompt_logprobs=0, ignore_eos=True)
    outputs = generator.generate([ids[w.begin:w.end] for w in spans], params, use_tqdm=False)
    total, count = 0.0, 0
    for window, output in zip(spans, outputs):
        prompt = ids[window.begin:window.end]
        entries = output.prompt_logprobs  # one per prompt token, None for the first
        for position in range(len(prompt) - window.num_scored, len(prompt)):
            total -= entries[position][prompt[position]]
            count += 1
    return total, count


@torch.inference_mode()
def hf_nll(model, ids: list[int], spans: list[Window]) -> tuple[float, int]:
    """The same sum from plain HF forwards (the model's own attention and dtype), one window at a time."""
    device = model.get_input_embeddings().weight.device
    total, count = 0.0, 0
    for window in spans:
        tokens = torch.tensor([ids[window.begin:window.end]], device=device)
        logprobs = model(input_ids=tokens).logits[0, :-1].float().log_softmax(-1)  # [len - 1, vocab]
        targets = tokens[0, 1:]
        chosen = logprobs.gather(1, targets[:, None])[:, 0][-window.num_scored:]
        total -= chosen.double().sum().item()
        count += chosen.shape[0]
    return total, count


def perplexity(nll: tuple[float, int]) -> float:
    return math.exp(nll[0] / nll[1])


def engine_perplexity(model, ids: list[int], context_len: int, stride: int, **config) -> float:
    """Perplexity through a fresh engine with PagedConfig `config` (kv_cache_dtype among them)."""
    config.setdefault("max_model_len", context_len + 1)
    generator = ContinuousBatchGenerator(model, PagedConfig(**config))
    try:
        return perplexity(engine_nll(generator, ids, windows(len(ids), context_len, stride)))
    finally:
        del generator
        gc.collect()  # the next engine's cache should not sit next to this one's


# --- the command --------------------------------------------------------------------------------------------------

def add_parser(sub) -> None:
    parser = sub.add_parser("eval-ppl", help="perplexity through the engine, per KV cache dtype, and plain HF's")
    parser.add_argument("--text", default=None, metavar="FILE", help="UTF-8 text (default: the built-in corpus of "
                        "standard-library docstrings)")
    parser.add_argument("--context-len", type=int, default=1024, help="tokens per window (default: 1024)")
    parser.add_argument("--stride", type=int, default=512, help="tokens between window ends, < --context-len "
                        "(default: 512)")
    parser.add_argument("--max-tokens", type=int, default=None, help="only the text's first N tokens")
    parser.add_argument("--kv-cache-dtypes", default=None, metavar="LIST",
                        help="comma list of KV cache dtypes to evaluate in turn (default: --kv-cache-dtype or auto)")
    parser.add_argument("--no-hf", action="store_true", help="skip plain HF's perplexity")
    add_model_args(parser)
    add_engine_args(parser)
    parser.set_defaults(func=cmd_eval_ppl)


def cmd_eval_ppl(args) -> int:
    config = engine_config(args)
    default_kv_dtype = config.pop("kv_cache_dtype", "auto")  # each evaluation sets its own
    kv_dtypes = [d.strip() for d in (args.kv_cache_dtypes or default_kv_dtype).split(",")]
    if args.text is None:
        text = stdlib_docstrings()
    else:
        with open(args.text, encoding="utf-8") as fh:
            text = fh.read()
    model, tokenizer = default_model.load_model(args.model, getattr(torch, args.dtype), args.device)
    quantization = config.pop("quantization", None)
    if quantization is not None:  # the engine and plain HF alike compute with the quantized linears
        quantize_model(model, quantization)
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"][:args.max_tokens]
    spans = windows(len(ids), args.context_len, args.stride)  # checks the numbers before any engine starts
    if not (config.get("num_blocks") or config.get("kv_cache_memory")):  # room for 16 windows at once
        config["num_blocks"] = 16 * cdiv(args.context_len + 1, config.get("block_size", 16))
    scored = sum(w.num_scored for w in spans)
    print(f"eval-ppl: {len(ids)} tokens, {len(spans)} windows of {args.context_len} (stride {args.stride}), "
          f"{scored} scored; model dtype {args.dtype}, linears {describe_linears(model)}", flush=True)
    results = {}
    for kv_dtype in kv_dtypes:
        results[kv_dtype] = engine_perplexity(model, ids, args.context_len, args.stride, kv_cache_dtype=kv_dtype,
                                              **config)
        print(f"  kv_cache_dtype {kv_dtype:9s} perplexity {results[kv_dtype]:.4f}", flush=True)
    if not args.no_hf:
        results["hf"] = perplexity(hf_nll(model, ids, spans))
        print(f"  plain HF ({args.dtype})   perplexity {results['hf']:.4f}", flush=True)
    base = results.get("auto", results.get("hf"))
    if base is not None:
        for name, value in results.items():
            print(f"  {name:9s} {100 * (value / base - 1):+.2f}% against {'auto' if 'auto' in results else 'hf'}")
    print(json.dumps({"num_tokens": len(ids), "num_scored": scored, "context_len": args.context_len,
                      "stride": args.stride, "dtype": args.dtype, "perplexity": results}))
    return 0
