"""Tensor parallelism: transformers' `tp_plan="auto"` under torchrun, served by the engine on every rank.

    torchrun --standalone --nproc-per-node 3 examples/tensor_parallel.py [--model PATH]

The ranks must divide the model's heads: the default model's 9 query and 3 KV heads split over 3 ranks, not 2.

Every rank loads its shard, holds its share of the KV heads in its own cache, and runs the same schedule on
the same requests; rank 0's sampled tokens are broadcast each step (gloo on CPU, NCCL on GPUs), so the ranks
never diverge. Only rank 0 prints.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer

import paged_hf
from paged_hf import SamplingParams
from paged_hf.loader.default_model import ensure_default_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder or hub id (default: SmolLM2-135M-Instruct)")
    args = parser.parse_args()

    path = args.model or str(ensure_default_checkpoint())  # rank 0 and 1 race safely: the conversion is locked
    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    engine = paged_hf.wrap(model, tokenizer, kv_cache_memory=1 << 30, max_model_len=2048).generator
    prompts = ["What is the capital of France?", "Write one sentence about the moon."]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for q in prompts]
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=32, temperature=0.7, seed=0),
                              use_tqdm=dist.get_rank() == 0)
    if dist.get_rank() == 0:
        print(f"KV heads per layer on this rank: {engine.info.num_kv_heads[0]}")
        for out in outputs:
            print(repr(out.outputs[0].text))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
