"""Run under `torchrun --nproc-per-node 2`: a tensor-parallel model (gloo, CPU) through the engine.

Rank 0 writes the greedy outputs (and a sampled run's tokens of every rank) to the JSON file given."""

import json
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import paged_hf
from paged_hf import SamplingParams

path, prompts_json, out_file = sys.argv[1:4]
prompts = json.loads(prompts_json)
model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float64)
engine = paged_hf.ContinuousBatchGenerator(model, paged_hf.PagedConfig(num_blocks=32, block_size=4))
greedy = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
torch.manual_seed(dist.get_rank())  # different global RNG per rank: only rank 0's draws may count
sampled = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=1.0, ignore_eos=True), use_tqdm=False)
gathered = [None] * dist.get_world_size()
dist.all_gather_object(gathered, [o.outputs[0].token_ids for o in sampled])
# a KV budget that differs per rank (as free memory does): the ranks must still agree on one pool size
sized = paged_hf.ContinuousBatchGenerator(model, paged_hf.PagedConfig(kv_cache_memory=(1 + dist.get_rank()) << 20))
num_blocks = [None] * dist.get_world_size()
dist.all_gather_object(num_blocks, sized.block_pool.num_blocks)
if dist.get_rank() == 0:
    result = {"kv_heads": engine.info.num_kv_heads, "greedy": [o.outputs[0].token_ids for o in greedy],
              "sampled": gathered, "num_blocks": num_blocks}
    with open(out_file, "w") as f:
        json.dump(result, f)
dist.destroy_process_group()
