"""Structured outputs on the default model: a JSON schema, a choice and a regex, enforced by the engine.

    python examples/structured_outputs.py [--model PATH]

Every answer follows its grammar (see docs/structured_outputs.md); the JSON one is checked with json.loads.
"""

from __future__ import annotations

import argparse
import json
import time

import paged_hf
from paged_hf import SamplingParams, StructuredOutputsParams
from paged_hf.loader.default_model import load_model

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "languages"],
          "properties": {"name": {"type": "string", "maxLength": 30},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "languages": {"type": "array", "items": {"enum": ["English", "French", "Spanish"]},
                                       "maxItems": 3}}}
REQUESTS = [
    ("Describe a French teacher as JSON.", StructuredOutputsParams(json=PERSON)),
    ("Is Paris the capital of France? Answer yes or no.", StructuredOutputsParams(choice=["yes", "no"])),
    ("Give a date in ISO format.", StructuredOutputsParams(regex=r"20[0-9]{2}-[01][0-9]-[0-3][0-9]")),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF folder or hub id (default: SmolLM2-135M-Instruct)")
    args = parser.parse_args()
    model, tokenizer = load_model(args.model)
    generator = paged_hf.wrap(model, tokenizer, num_blocks=64).generator
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for q, _ in REQUESTS]
    params = [SamplingParams(temperature=0, max_new_tokens=80, structured_outputs=spec) for _, spec in REQUESTS]
    start = time.perf_counter()
    outputs = generator.generate(prompts, params, use_tqdm=False)
    print(f"{len(outputs)} answers in {time.perf_counter() - start:.1f} s")
    for (question, spec), out in zip(REQUESTS, outputs):
        completion = out.outputs[0]
        print(f"\n[{spec.kind}] {question}\n  -> {completion.text!r} ({completion.finish_reason})")
    print("\nparsed:", json.loads(outputs[0].outputs[0].text))


if __name__ == "__main__":
    main()
