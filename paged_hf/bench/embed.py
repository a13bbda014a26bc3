"""`paged-hf bench --workload embed`: embedding throughput of paged_hf (offline, and `/v1/embeddings` of a real
`paged-hf serve`) beside sentence-transformers' `encode`, on the same short texts and the same model folder.

The texts are seeded windows of the bench's corpus (workloads.py), 8-48 tokens each: queries and sentences, what
a retrieval pipeline embeds. The model is made into a sentence-transformers folder once, by
sentence-transformers itself (last-token pooling and Normalize, its configuration for a decoder model), and
kept in the cache folder; a `--model` that already is one (it has `modules.json`) is used as it is. Every system
loads that folder, so all of them pool as it says, and their vectors are compared (max |difference| and the
lowest cosine similarity against sentence_transformers').
"""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

from paged_hf.bench.embed_systems import EMBED_SYSTEMS, run_in_worker, run_paged_hf_embed_serve
from paged_hf.bench.workloads import corpus_token_ids, passage
from paged_hf.config.groups import CacheConfig
from paged_hf.loader.default_model import ensure_default_checkpoint, is_default_model
from paged_hf.utils import cache_root, cdiv, cpu_model_name, describe_host

REFERENCE = "sentence_transformers"
#: the serving system's clients: each request carries this many texts (a retrieval indexer sends its chunks in
#: small batches; the queries of many users would be one text each), `--concurrency` requests in flight
TEXTS_PER_REQUEST = 4
NUM_TEXTS = 256
#: timed runs of each system (after its warm-up): its best time is reported, every time is in the JSON
REPEATS = 3


def _log(message: str) -> None:
    print(f"[paged-hf bench] {message}", file=sys.stderr, flush=True)


def embed_texts(tokenizer, seed: int = 0, num_texts: int = NUM_TEXTS, token_range=(8, 48)) -> list[str]:
    """`num_texts` seeded windows of the corpus, `token_range` tokens each, as text."""
    rng = random.Random(seed)
    corpus = corpus_token_ids(tokenizer)
    return [passage(tokenizer, corpus, rng.randint(*token_range), rng) for _ in range(num_texts)]


def embedding_folder(model: str | None) -> str:
    """A sentence-transformers folder of `model` (None: the default model): `model` itself if it is one, else one
    made by sentence-transformers (Transformer, last-token Pooling, Normalize) in the cache folder, once."""
    if not is_default_model(model) and Path(model, "modules.json").is_file():
        return str(model)
    source = str(ensure_default_checkpoint()) if is_default_model(model) else str(model)
    key = re.sub(r"[^A-Za-z0-9_.-]+", "_", "default" if is_default_model(model) else str(model)).strip("_")
    folder = cache_root() / "bench_embed" / key
    if not (folder / "modules.json").is_file():
        _log(f"making a sentence-transformers folder of {source} in {folder} (once) ...")
        folder.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder.parent, prefix=f".{key}_") as tmp:
            save_lasttoken_folder(source, Path(tmp, "st"))
            if not (folder / "modules.json").is_file():  # another bench may have finished first
                shutil.rmtree(folder, ignore_errors=True)
                os.replace(Path(tmp, "st"), folder)
    return str(folder)


def save_lasttoken_folder(source: str, folder: Path) -> None:
    """sentence-transformers' own folder for a decoder embedder: last-token pooling, then Normalize. The text
    modality only: sentence-transformers >= 6 would otherwise render each text through the chat template."""
    from sentence_transformers import SentenceTransformer  # noqa: PLC0415 - the bench/test extras have it
    from sentence_transformers.sentence_transformer import modules  # noqa: PLC0415

    transformer = modules.Transformer(source)
    transformer.modality_config.pop("message", None)
    pooling = modules.Pooling(transformer.get_embedding_dimension(), pooling_mode="lasttoken")
    SentenceTransformer(modules=[transformer, pooling, modules.Normalize()], device="cpu").save(str(folder))


def sized_embed_config(engine_config: dict, num_tokens: list[int]) -> dict:
    """Prefix caching off: each timed run embeds the same texts again, and with it on every run after the first
    would read most of their blocks from the cache (distinct texts, as in one run, share none). Without
    --num-blocks or --kv-cache-memory, a KV cache that holds every text at once (and no more): the engine's CPU
    default would reserve up to 4 GiB of zeros."""
    config = dict(engine_config, enable_prefix_caching=False)
    if config.get("num_blocks") or config.get("kv_cache_memory"):
        return config
    block_size = config.get("block_size", CacheConfig.block_size)
    return dict(config, num_blocks=sum(cdiv(n, block_size) for n in num_tokens) + 4)


def compare_vectors(vectors: list[list[float]], reference: list[list[float]]) -> dict:
    """max |a - b| over every component, and the lowest cosine similarity of a text's two vectors."""
    import torch  # noqa: PLC0415

    a, b = torch.tensor(vectors, dtype=torch.float64), torch.tensor(reference, dtype=torch.float64)
    if a.shape != b.shape:
        return {"error": f"shape {tuple(a.shape)} against {tuple(b.shape)}"}
    cosine = torch.nn.functional.cosine_similarity(a, b, dim=1)
    return {"max_abs_diff": (a - b).abs().max().item(), "min_cosine": cosine.min().item()}


def parse_embed_systems(value: str | None) -> list[str]:
    systems = [s.strip() for s in (value or ",".join(EMBED_SYSTEMS)).split(",") if s.strip()]
    unknown = [s for s in systems if s not in EMBED_SYSTEMS]
    if unknown:
        raise ValueError(f"unknown system(s) {unknown} for --workload embed; known: {', '.join(EMBED_SYSTEMS)}")
    return list(dict.fromkeys(systems))


def run_embed_bench(args) -> int:
    """Every system on the same texts; prints the table (bench_embed.json in --out); 1 if a system failed."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    systems = parse_embed_systems(args.systems)
    if (args.requests is not None and args.requests < 1) or args.concurrency < 1:
        raise ValueError(f"--requests and --concurrency must be >= 1, got {args.requests} and {args.concurrency}")
    folder = embedding_folder(args.model)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    texts = embed_texts(tokenizer, args.seed, args.requests or NUM_TEXTS)
    num_tokens = [len(ids) for ids in tokenizer(texts)["input_ids"]]  # as the server and LLM.embed count them
    spec = {"folder": folder, "texts": texts, "device": args.device, "dtype": args.dtype, "threads": args.threads,
            "engine_config": sized_embed_config(args.engine_config, num_tokens), "repeats": REPEATS}
    _log(f"workload embed: {len(texts)} texts, {sum(num_tokens)} tokens; systems: {', '.join(systems)}")
    runs = {}
    for system in systems:
        _log(f"running {system} in a fresh process ...")
        if system == "paged_hf_embed_serve":
            runs[system] = run_paged_hf_embed_serve(folder, texts, spec, args.concurrency, TEXTS_PER_REQUEST,
                                                    args.server_timeout, args.system_timeout)
        else:
            runs[system] = run_in_worker(system, spec, args.system_timeout)
        run = runs[system]
        walls = ", ".join(f"{wall:.1f}" for wall in run.get("walls_s", []))
        _log(f"{system}: {run.get('error') or walls + ' s timed'}")
    argv = getattr(args, "argv", None)
    settings = {"model": args.model or "SmolLM2-135M-Instruct (default)", "folder": folder, "device": args.device,
                "dtype": args.dtype, "threads": args.threads, "repeats": REPEATS,
                "engine_config": spec["engine_config"],
                "host": describe_host(), "cpu": cpu_model_name(), "date": time.strftime("%Y-%m-%d"),
                "command": "paged-hf " + shlex.join(argv) if argv is not None else "paged-hf bench --workload embed"}
    report = build_embed_report(len(texts), num_tokens, args.seed, runs, settings)
    print(format_embed_table(report), flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        name = "bench_embed" + ("" if args.dtype == "float32" else f"_{args.dtype}")  # as report.output_name
        path = os.path.join(args.out, f"{name}.json")
        with open(path, "w") as fh:
            json.dump(report, fh, indent=2)
        _log(f"wrote {path}")
    return 1 if any(run.get("error") for run in runs.values()) else 0


def build_embed_report(num_texts: int, num_tokens: list[int], seed: int, runs: dict, settings: dict) -> dict:
    """Per system: texts/s, tokens/s, peak RSS, its ratio to sentence_transformers' texts/s and how far its
    vectors are from sentence_transformers' (or, without it, from the first system's)."""
    ok = {name: run for name, run in runs.items() if not run.get("error")}
    reference = REFERENCE if REFERENCE in ok else next(iter(ok), None)
    base = ok[REFERENCE]["wall_s"] if REFERENCE in ok else None
    systems = {}
    for name, run in runs.items():
        if run.get("error"):
            systems[name] = {"error": run["error"]}
            continue
        wall = run["wall_s"]
        systems[name] = {"wall_s": wall, "walls_s": run.get("walls_s"), "texts_per_s": num_texts / wall,
                         "tokens_per_s": sum(num_tokens) / wall,
                         "vs_sentence_transformers": base / wall if base else None,
                         "peak_rss_bytes": run.get("peak_rss_bytes"), "num_threads": run.get("num_threads"),
                         "extra": run.get("extra", {}),
                         "vectors_vs_reference": compare_vectors(run["vectors"], ok[reference]["vectors"])}
    workload = {"name": "embed", "num_texts": num_texts, "tokens": sum(num_tokens), "seed": seed,
                "tokens_range": [min(num_tokens), max(num_tokens)]}
    return {"workload": workload, "settings": settings, "reference_system": reference, "systems": systems}


def format_embed_table(report: dict) -> str:
    w, settings = report["workload"], report["settings"]
    lines = [f"workload embed: {w['num_texts']} texts, {w['tokens']} tokens ({w['tokens_range'][0]}-"
             f"{w['tokens_range'][1]} each, seed {w['seed']}); vectors compared with {report['reference_system']}",
             "| system | texts/s | tokens/s | best wall s | peak RSS GB | x sentence_transformers | max abs diff | "
             "min cosine |", "|---|---|---|---|---|---|---|---|"]
    for name, m in report["systems"].items():
        if "error" in m:
            lines.append(f"| {name} | error: {m['error'][:200]} | | | | | | |")
            continue
        agree, rss, ratio = m["vectors_vs_reference"], m["peak_rss_bytes"], m["vs_sentence_transformers"]
        lines.append(f"| {name} | {m['texts_per_s']:.1f} | {m['tokens_per_s']:.0f} | {m['wall_s']:.2f} | "
                     f"{'-' if rss is None else format(rss / 1e9, '.2f')} | "
                     f"{'-' if ratio is None else format(ratio, '.2f') + 'x'} | "
                     f"{agree.get('max_abs_diff', float('nan')):.2e} | {agree.get('min_cosine', float('nan')):.6f} |")
    serve = report["systems"].get("paged_hf_embed_serve", {}).get("extra")
    if serve:
        lines.append(f"paged_hf_embed_serve: {serve['num_requests']} POST /v1/embeddings of "
                     f"{serve['texts_per_request']} texts, {serve['concurrency']} in flight, "
                     f"encoding_format {serve['encoding_format']}")
    lines.append(f"each system: a warm-up, then {settings.get('repeats')} timed runs over every text; the best is "
                 "shown, every time is in the JSON (walls_s)")
    lines.append(f"measured on {settings['host']}, {settings['dtype']}: {settings['command']}")
    return "\n".join(lines)
