"""Multi-LoRA serving: three adapters and the base model in one batch, through two device slots.

Creates three random peft LoRA adapters for the default model in a temporary folder (different ranks,
target modules, one rsLoRA; no hub access needed), loads them into the engine and serves a batch in which
every request names its own adapter (or none). Random adapters do not teach the model anything: the point
is that each request gets the tokens its adapter gives on its own (checked here against a merged copy of
the model for one request per adapter), while all of them share the same steps.

    python examples/multi_lora.py [--model PATH] [--max-loras N] [--max-new-tokens N]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import paged_hf
from paged_hf import SamplingParams
from paged_hf.integrations.peft import save_random_adapter
from paged_hf.loader.default_model import load_model

ADAPTERS = {  # name -> LoraConfig fields
    "qv_r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "all_r16_rslora": dict(r=16, lora_alpha=16, target_modules="all-linear", use_rslora=True),
    "mlp_r4": dict(r=4, lora_alpha=8, target_modules=["down_proj", "o_proj"]),
}
QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea.",
             "What is 12 times 12?", "Who wrote 'Romeo and Juliet'?", "Give one tip for learning to code."]


def oracle(model, folder: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The same request through plain peft + HF generate (one prompt, the adapter merged into a copy)."""
    import copy  # noqa: PLC0415

    import torch  # noqa: PLC0415
    from peft import PeftModel  # noqa: PLC0415

    merged = PeftModel.from_pretrained(copy.deepcopy(model), folder).merge_and_unload().eval()
    out = merged.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder or hub id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--max-loras", type=int, default=2, help="adapters resident at once (the rest wait on CPU)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()

    model, tokenizer = load_model(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        folders = {name: save_random_adapter(model, Path(tmp) / name, seed=i, std=0.05, **config)
                   for i, (name, config) in enumerate(ADAPTERS.items())}
        wrapped = paged_hf.wrap(model, tokenizer, adapters=folders, max_loras=args.max_loras, max_lora_rank=16,
                                kv_cache_memory=1 << 30, max_model_len=2048)
        engine = wrapped.generator
        names = [None, *ADAPTERS]
        requests = [(q, names[i % len(names)]) for i, q in enumerate(QUESTIONS * 2)]
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=False) for q, _ in requests]
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0)
        start = time.perf_counter()
        outputs = engine.generate(prompts, params, adapters=[a for _, a in requests])
        elapsed = time.perf_counter() - start

        for (question, adapter), output in list(zip(requests, outputs))[: len(names)]:
            print(f"\n[{adapter or 'base'}] Q: {question}\nA: {output.outputs[0].text.strip()}")
        num_generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        print(f"\n{len(prompts)} requests on {len(ADAPTERS)} adapters + base, {num_generated} tokens in "
              f"{elapsed:.1f} s ({num_generated / elapsed:.1f} tokens/s), max_loras={args.max_loras}, "
              f"{engine.runner.lora.num_swaps} adapter swaps into slots")
        for i, name in enumerate(ADAPTERS, start=1):
            same = outputs[i].outputs[0].token_ids == oracle(model, folders[name], prompts[i], args.max_new_tokens)
            print(f"{name}: {'same tokens as' if same else 'DIFFERS from'} peft + HF generate on its own")


if __name__ == "__main__":
    main()
