"""accelerate device maps: offloaded and split models give HF's greedy tokens; KV sized per device."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_no_leak, hf_greedy, random_prompts, tiny_model
from transformers import AutoModelForCausalLM

import paged_hf
from paged_hf import PagedConfig, SamplingParams
from paged_hf.cache_sizing import bytes_per_block, num_blocks_from_memory


def dispatched(tmp_path, device_map):
    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "model")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model", device_map=device_map, dtype=torch.float64,
                                                  offload_folder=str(tmp_path / "offload"))
    loaded.generation_config.eos_token_id = None
    return model, loaded


def test_model_with_a_layer_offloaded_to_disk_gives_hf_greedy_tokens(tmp_path):
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    original, offloaded = dispatched(tmp_path, device_map)
    assert any(p.device.type == "meta" for p in offloaded.parameters()), "nothing was offloaded"
    prompts = random_prompts([7, 15, 11])
    expected = [hf_greedy(original, p, 6) for p in prompts]
    generator = paged_hf.ContinuousBatchGenerator(offloaded, PagedConfig(num_blocks=32, block_size=4))
    assert generator.info.layer_devices == [torch.device("cpu")] * 2
    outputs = generator.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert_no_leak(generator)


def test_kv_cache_memory_in_bytes_sizes_the_pool(llama):
    generator = paged_hf.ContinuousBatchGenerator(llama, PagedConfig(block_size=4, kv_cache_memory=1 << 20))
    per_block = bytes_per_block(4, generator.info.num_kv_heads, generator.info.head_dim, torch.float64)
    assert generator.stats()["num_blocks"] == (1 << 20) // per_block
    assert generator.runner.cache.key_cache[0].shape[0] == generator.stats()["num_blocks"]
    capped = num_blocks_from_memory(generator.info, PagedConfig(block_size=4, kv_cache_memory=1 << 30, max_num_seqs=2), 64)
    assert capped == 2 * 16  # never more blocks than max_num_seqs full-length sequences can use


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_layers_split_between_cuda_and_cpu(tmp_path):
    device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": "cpu", "model.norm": "cpu",
                  "model.rotary_emb": 0, "lm_head": "cpu"}
    original, split = dispatched(tmp_path, device_map)
    prompts = random_prompts([7, 15])
    expected = [hf_greedy(original, p, 6) for p in prompts]
    generator = paged_hf.ContinuousBatchGenerator(split, PagedConfig(num_blocks=32, block_size=4, attention_backend="torch"))
    assert [d.type for d in generator.info.layer_devices] == ["cuda", "cpu"]
    assert generator.runner.cache.key_cache[0].device.type == "cuda"
    outputs = generator.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
