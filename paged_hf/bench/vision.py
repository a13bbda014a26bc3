"""`paged-hf bench --workload vision`: requests of one or two images and a question, on an Idefics3 model of
SmolVLM-256M's shape with random weights (vision_model.py), paged_hf against HF's `generate` one request at a time, in
one process; then a two-turn chat about one image, where the second turn's prompt holds the first turn's (its image
included) and paged_hf's prefix cache serves it.

Both systems run the same model object on the same processor outputs: HF first, on the plain model, then
`paged_hf.wrap(model, processor)`. Every request is greedy and generates exactly its `max_new_tokens` (the model has
no EOS), so both do the same work; each system has one warm-up request first (another image, not timed). The images
are seeded noise of at most one tile, so each costs the vision tower one tile in either system (the encoder-output
cache never sees one twice: none repeats).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from paged_hf.bench.vision_model import build_vision_model, tile_size
from paged_hf.utils import cdiv, describe_host

QUESTIONS = ("What is in this image?", "Describe the picture in detail.", "What colors dominate here?",
             "Is there any text in the image?", "Compare what you see.", "What happens in this scene?")
#: requests with two images: every third
TWO_IMAGES_EVERY = 3
DEFAULT_REQUESTS = 8
DEFAULT_NEW_TOKENS = 64
FOLLOW_UP = "And what is in its upper left corner?"


@dataclass
class VisionRequest:
    text: str
    images: list
    max_new_tokens: int
    prompt_tokens: int = 0  # the processor's expanded prompt
    tokens: dict = field(default_factory=dict)  # system -> its generated token ids


def _log(message: str) -> None:
    print(f"[paged-hf bench] {message}", file=sys.stderr, flush=True)


def chat_text(question: str, num_images: int) -> str:
    """SmolVLM's chat format for one user turn, the images first."""
    return f"<|im_start|>User:{'<image>' * num_images}{question}<end_of_utterance>\nAssistant:"


def random_image(rng: random.Random, tile: int):
    """Seeded noise of at most one tile, landscape or portrait."""
    import numpy as np  # noqa: PLC0415
    from PIL import Image  # noqa: PLC0415

    short = max(8, tile * 3 // 4)
    height, width = (short, tile) if rng.random() < 0.5 else (tile, short)
    pixels = np.random.RandomState(rng.randrange(1 << 30)).rand(height, width, 3) * 255
    return Image.fromarray(pixels.astype("uint8"))


def vision_requests(shape: str, num_requests: int, max_new_tokens: int, seed: int) -> list[VisionRequest]:
    rng = random.Random(seed)
    requests = []
    for i in range(num_requests):
        count = 2 if i % TWO_IMAGES_EVERY == TWO_IMAGES_EVERY - 1 else 1
        requests.append(VisionRequest(chat_text(QUESTIONS[i % len(QUESTIONS)], count),
                                      [random_image(rng, tile_size(shape)) for _ in range(count)], max_new_tokens))
    return requests


def hf_inputs(model, processor, text: str, images) -> dict:
    inputs = processor(text=text, images=images, return_tensors="pt")
    inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype)
    return inputs


def hf_generate(model, processor, request: VisionRequest) -> list[int]:
    """HF's greedy tokens of one request (processor and model, as a user runs them)."""
    inputs = hf_inputs(model, processor, request.text, request.images)
    request.prompt_tokens = inputs["input_ids"].shape[1]
    out = model.generate(**inputs, max_new_tokens=request.max_new_tokens, do_sample=False)
    return out[0, request.prompt_tokens:].tolist()


def run_hf(model, processor, requests: list[VisionRequest], warm_up: VisionRequest) -> tuple[float, float]:
    """HF's `generate` one request at a time -> (wall, CPU) seconds (after the warm-up request)."""
    with torch.inference_mode():
        hf_generate(model, processor, warm_up)
        start, cpu = time.perf_counter(), time.process_time()
        for request in requests:
            request.tokens["hf_generate"] = hf_generate(model, processor, request)
        return time.perf_counter() - start, time.process_time() - cpu


def _params(max_new_tokens: int):
    from paged_hf import SamplingParams  # noqa: PLC0415 - the public API, as a user calls it

    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True)


def _prompt(request: VisionRequest) -> dict:
    return {"prompt": request.text, "multi_modal_data": {"image": request.images}}


def run_paged(generator, requests: list[VisionRequest], warm_up: VisionRequest) -> tuple[float, float]:
    """paged_hf's engine on every request at once -> (wall, CPU) seconds (after the warm-up request): on a shared
    host the CPU seconds (all of this process's threads) say what the work cost when others took the cores."""
    generator.generate([_prompt(warm_up)], _params(warm_up.max_new_tokens), use_tqdm=False)
    start, cpu = time.perf_counter(), time.process_time()
    outputs = generator.generate([_prompt(r) for r in requests], [_params(r.max_new_tokens) for r in requests],
                                 use_tqdm=False)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    for request, output in zip(requests, outputs):
        request.tokens["paged_hf"] = list(output.outputs[0].token_ids)
    return wall, cpu


def two_turns(model, processor, generator, image, max_new_tokens: int) -> dict:
    """A two-turn chat about one image: each system's turn times; paged_hf's second turn's prefix cache hits.
    `generator` None: HF's `generate` (the whole prompt, the image's tower included, again in turn 2)."""
    text = chat_text(QUESTIONS[0], 1)
    first_ids = processor(text=text, images=[image], return_tensors="pt")["input_ids"][0].tolist()
    follow_up = processor.tokenizer(f"<end_of_utterance>\nUser:{FOLLOW_UP}<end_of_utterance>\nAssistant:",
                                    add_special_tokens=False)["input_ids"]
    times, answer = [], []
    for turn in range(2):
        ids = first_ids if turn == 0 else first_ids + answer + follow_up
        before = generator.stats() if generator is not None else None
        start = time.perf_counter()
        if generator is None:
            with torch.inference_mode():
                inputs = hf_inputs(model, processor, text, [image])
                out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     pixel_values=inputs["pixel_values"],
                                     pixel_attention_mask=inputs.get("pixel_attention_mask"),
                                     max_new_tokens=max_new_tokens, do_sample=False)
            tokens = out[0, len(ids):].tolist()
        else:
            prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": [image]}}
            tokens = list(generator.generate([prompt], _params(max_new_tokens), use_tqdm=False)[0].outputs[0].token_ids)
        times.append(time.perf_counter() - start)
        answer = answer or tokens
    result = {"turn_1_s": times[0], "turn_2_s": times[1], "turn_2_prompt_tokens": len(first_ids + answer + follow_up)}
    if generator is not None:
        after = generator.stats()
        hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
        queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
        result.update(turn_2_prefix_hit_tokens=hits, turn_2_prefix_hit_rate=hits / max(queries, 1))
    return result


def sized_config(engine_config: dict, requests: list[VisionRequest], block_size: int, extra_tokens: int) -> dict:
    """A KV pool that holds every request at once (and the chat's turns), unless the flags size it."""
    if engine_config.get("num_blocks") or engine_config.get("kv_cache_memory"):
        return dict(engine_config)
    needed = sum(cdiv(r.prompt_tokens + r.max_new_tokens, block_size) for r in requests)
    return dict(engine_config, num_blocks=needed + cdiv(extra_tokens, block_size) + 8)


def system_figures(requests: list[VisionRequest], system: str, times: tuple[float, float, float]) -> dict:
    """`times`: (wall s, CPU s, the host's 1-minute load average when the system finished)."""
    new_tokens = sum(len(r.tokens[system]) for r in requests)
    wall, cpu, load = times
    return {"wall_s": wall, "cpu_s": cpu, "new_tokens": new_tokens, "new_tokens_per_s": new_tokens / wall,
            "new_tokens_per_cpu_s": new_tokens / cpu, "load_average_1m": load}


def run_vision_bench(args) -> int:
    """The vision workload as `paged-hf bench` flags ask: --vision-shape, --requests, --max-new-tokens-scale,
    --dtype, --threads, --seed, --out and the engine flags."""
    shape = getattr(args, "vision_shape", None) or "smolvlm-256m"
    if args.threads:
        torch.set_num_threads(args.threads)
    num_requests = args.requests or DEFAULT_REQUESTS
    max_new = max(1, round(DEFAULT_NEW_TOKENS * (args.max_new_tokens_scale or 1.0)))
    _log(f"building the {shape} model (random weights, {args.dtype}) and its processor ...")
    model, processor = build_vision_model(shape, getattr(torch, args.dtype), args.seed)
    requests = vision_requests(shape, num_requests, max_new, args.seed)
    rng = random.Random(args.seed + 1)
    warm_up, chat_image = VisionRequest(chat_text(QUESTIONS[1], 1), [random_image(rng, tile_size(shape))], 4), \
        random_image(rng, tile_size(shape))
    _log(f"{num_requests} requests, {sum(len(r.images) for r in requests)} images, {max_new} new tokens each: "
         "hf_generate one at a time ...")
    walls = {"hf_generate": (*run_hf(model, processor, requests, warm_up), os.getloadavg()[0])}
    chats = {"hf_generate": two_turns(model, processor, None, chat_image, max_new)}
    import paged_hf  # noqa: PLC0415 - the public API, as a user calls it

    config = sized_config(args.engine_config, requests, args.engine_config.get("block_size", 16), 4 * 1024)
    generator = paged_hf.wrap(model, processor, **config).generator
    _log("paged_hf ...")
    walls["paged_hf"] = (*run_paged(generator, requests, warm_up), os.getloadavg()[0])
    chats["paged_hf"] = two_turns(model, processor, generator, chat_image, max_new)
    report = vision_report(args, shape, requests, walls, chats, config)
    print(format_vision_table(report), flush=True)
    if args.out:
        path = Path(args.out) / "bench_vision.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
        _log(f"wrote {path}")
    return 0


def vision_report(args, shape: str, requests: list[VisionRequest], walls: dict, chats: dict, config: dict) -> dict:
    systems = {name: system_figures(requests, name, wall) for name, wall in walls.items()}
    for name, figures in systems.items():
        figures["vs_hf_generate"] = figures["new_tokens_per_s"] / systems["hf_generate"]["new_tokens_per_s"]
        figures["cpu_vs_hf_generate"] = figures["new_tokens_per_cpu_s"] / systems["hf_generate"]["new_tokens_per_cpu_s"]
        figures["two_turn_chat"] = chats[name]
    equal = sum(r.tokens["paged_hf"] == r.tokens["hf_generate"] for r in requests)
    argv = getattr(args, "argv", None)
    return {"workload": {"name": "vision", "shape": shape, "num_requests": len(requests),
                         "num_images": sum(len(r.images) for r in requests),
                         "prompt_tokens": sum(r.prompt_tokens for r in requests),
                         "max_new_tokens": requests[0].max_new_tokens if requests else 0},
            "systems": systems, "requests_with_equal_tokens": equal,
            "settings": {"dtype": args.dtype, "threads": torch.get_num_threads(), "engine_config": config,
                         "host": describe_host(), "date": time.strftime("%Y-%m-%d"),
                         "command": "paged-hf " + " ".join(argv) if argv else "paged-hf bench --workload vision"}}


def format_vision_table(report: dict) -> str:
    work = report["workload"]
    lines = [f"vision workload ({work['shape']}): {work['num_requests']} requests, {work['num_images']} images, "
             f"{work['prompt_tokens']} prompt tokens, {work['max_new_tokens']} new tokens each; "
             f"{report['settings']['host']}, {report['settings']['threads']} threads",
             "| system | wall s | new tokens/s | vs hf_generate | CPU s | per CPU s vs hf_generate | chat turn 1 s | "
             "chat turn 2 s | turn 2 prefix hits | host load |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, figures in report["systems"].items():
        chat = figures["two_turn_chat"]
        hits = chat.get("turn_2_prefix_hit_tokens")
        hit = "-" if hits is None else f"{hits} of {chat['turn_2_prompt_tokens']} ({chat['turn_2_prefix_hit_rate']:.0%})"
        lines.append(f"| {name} | {figures['wall_s']:.2f} | {figures['new_tokens_per_s']:.1f} | "
                     f"{figures['vs_hf_generate']:.2f}x | {figures['cpu_s']:.2f} | {figures['cpu_vs_hf_generate']:.2f}x "
                     f"| {chat['turn_1_s']:.2f} | {chat['turn_2_s']:.2f} | {hit} | {figures['load_average_1m']:.1f} |")
    lines.append(f"requests whose tokens equal HF's: {report['requests_with_equal_tokens']} of {work['num_requests']}")
    return "\n".join(lines)
