"""Offline batch: a batch of chat prompts through the engine on the default model (this is `make demo`).

    python examples/offline_batch.py [--model PATH] [--dtype auto] [--num-prompts N] [--max-new-tokens N]

It prints the dtype it ran in and the CPU (and GPU) it ran on next to its tokens/s: a speed means nothing without
them (`--dtype auto`: the checkpoint's dtype where the CPU computes it natively, docs/api.md).
"""

from __future__ import annotations

import argparse
import time

import torch

import paged_hf
from paged_hf import SamplingParams
from paged_hf.loader.default_model import load_model
from paged_hf.loader.device_dtype import DTYPE_NAMES, resolve_device, resolve_model_dtype
from paged_hf.utils import describe_host

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 12 times 12?",
    "Write a haiku about the sea.",
    "Why is the sky blue? Answer in one sentence.",
    "Give me a synonym for 'happy'.",
    "What language is spoken in Brazil?",
    "Explain what a CPU does in one sentence.",
    "List the planets of the solar system.",
    "What is the boiling point of water in Celsius?",
    "Suggest a name for a pet turtle.",
    "Translate 'good morning' into Spanish.",
    "Who wrote 'Romeo and Juliet'?",
    "What is photosynthesis? Keep it short.",
    "How many days are in a leap year?",
    "Give one tip for learning to code.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder or hub id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_NAMES, help="as `paged-hf serve --dtype`")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()

    device = resolve_device("auto")
    dtype = resolve_model_dtype(args.dtype, device, args.model)
    model, tokenizer = load_model(args.model, dtype.dtype, device)
    engine = paged_hf.wrap(model, tokenizer, max_model_len=2048, kv_cache_memory=1 << 30).generator
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.num_prompts)]
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                      return_dict=False)
        for q in questions
    ]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0)

    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start

    for question, output in list(zip(questions, outputs))[:4]:
        print(f"\nQ: {question}\nA: {output.outputs[0].text.strip()}")
    num_generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"\n{len(prompts)} requests, {num_generated} tokens generated in {elapsed:.1f} s: "
          f"{num_generated / elapsed:.1f} tokens/s in {dtype.name} on {describe_host()}, {device}, "
          f"{torch.get_num_threads()} threads (dtype {dtype.reason})")


if __name__ == "__main__":
    main()
