"""A model split over several devices with accelerate's device map, served by one engine.

    python examples/multi_gpu.py [--model PATH] [--device-map auto]

Each layer's KV blocks live on the device that layer computes on; block ids are shared by all devices. On a
machine without GPUs `auto` places everything on the CPU (or offloads to disk when RAM is short).
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import paged_hf
from paged_hf import SamplingParams
from paged_hf.loader.default_model import ensure_default_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder or hub id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--device-map", default="auto")
    args = parser.parse_args()

    path = args.model or str(ensure_default_checkpoint())
    model = AutoModelForCausalLM.from_pretrained(path, device_map=args.device_map, dtype=torch.float32,
                                                 offload_folder=tempfile.mkdtemp())
    tokenizer = AutoTokenizer.from_pretrained(path)
    print("device map:", getattr(model, "hf_device_map", None))
    engine = paged_hf.wrap(model, tokenizer, kv_cache_memory=1 << 30, max_model_len=2048).generator
    print("KV cache devices per layer:", sorted({str(d) for d in engine.info.layer_devices}))
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False)
               for q in ["What is the capital of France?", "Name a prime number."]]
    for out in engine.generate(prompts, SamplingParams(max_new_tokens=32, temperature=0)):
        print(repr(out.outputs[0].text))


if __name__ == "__main__":
    main()
