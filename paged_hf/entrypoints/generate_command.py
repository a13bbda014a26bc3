"""`paged-hf generate`: an offline batch from a JSONL file, one request per line, outputs in input order."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields

import torch

import paged_hf
from paged_hf.entrypoints.cli_args import engine_config
from paged_hf.loader import default_model
from paged_hf.sampling_params import SamplingParams

#: Fields a JSONL line may set (eos_token_ids is internal, not part of the public contract).
SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams) if f.name != "eos_token_ids")


def parse_request_line(line: str, number: int, defaults: dict) -> tuple:
    """One JSONL line -> (id, prompt or messages, SamplingParams, adapter), checked before any model is loaded.
    A bad line is a ValueError naming its line number."""
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"line {number}: not valid JSON ({exc})") from None
    if not isinstance(item, dict):
        raise ValueError(f"line {number}: expected a JSON object")
    unknown = sorted(set(item) - {"id", "prompt", "messages", "adapter", *SAMPLING_FIELDS})
    if unknown:
        raise ValueError(f"line {number}: unknown field(s) {unknown}")
    if ("prompt" in item) == ("messages" in item):
        raise ValueError(f"line {number}: give exactly one of 'prompt' (a string or token ids) or 'messages'")
    if "messages" in item and not (isinstance(item["messages"], list) and item["messages"]):
        raise ValueError(f"line {number}: 'messages' must be a non-empty list of chat messages")
    sampling = {**defaults, **{k: v for k, v in item.items() if k in SAMPLING_FIELDS}}
    try:
        params = SamplingParams(**sampling)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"line {number}: {exc}") from None
    prompt = {"messages": item["messages"]} if "messages" in item else item["prompt"]
    return item.get("id", number), prompt, params, item.get("adapter")


def to_prompt(prompt, tokenizer):
    """Chat messages go through the model's chat template; strings and token ids go to the engine as they are."""
    if isinstance(prompt, dict):
        return list(tokenizer.apply_chat_template(prompt["messages"], add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    return prompt


def output_record(request_id, output) -> dict:
    first = output.outputs[0]
    record = {"id": request_id, "num_prompt_tokens": len(output.prompt_token_ids), "text": first.text,
              "token_ids": first.token_ids, "finish_reason": first.finish_reason}
    if len(output.outputs) > 1:
        record["outputs"] = [{"text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason}
                             for o in output.outputs]
    return record


def cmd_generate(args: argparse.Namespace) -> int:
    """Offline batch: every line of the input file is one request; all run together, outputs in input order."""
    defaults = {k: v for k, v in (("max_new_tokens", args.max_new_tokens), ("temperature", args.temperature))
                if v is not None}
    with open(args.input) as fh:
        requests = [parse_request_line(line, n, defaults) for n, line in enumerate(fh, 1) if line.strip()]
    if not requests:
        raise ValueError(f"{args.input} holds no requests")

    config = engine_config(args)
    model, tokenizer = default_model.load_model(args.model, getattr(torch, args.dtype), args.device)
    generator = paged_hf.wrap(model, tokenizer, **config).generator
    outputs = generator.generate([to_prompt(r[1], tokenizer) for r in requests], [r[2] for r in requests],
                                 adapters=[r[3] for r in requests], use_tqdm=not args.quiet)
    lines = [json.dumps(output_record(r[0], output)) + "\n" for r, output in zip(requests, outputs)]
    if args.output in (None, "-"):
        sys.stdout.writelines(lines)
    else:
        with open(args.output, "w") as out:
            out.writelines(lines)
    return 0
