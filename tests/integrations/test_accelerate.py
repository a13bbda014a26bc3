"""accelerate device maps: offloaded and split models give HF's greedy tokens; KV sized per device."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_no_leak, hf_greedy, random_prompts, tiny_model
from transformers import AutoModelForCausalLM

import paged_hf
from paged_hf import PagedConfig, SamplingParams
from paged_hf.worker.cache_sizing import bytes_per_block, num_blocks_from_memory


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
def test_modules_mapped_to_cpu_beside_a_gpu_run_on_the_gpu(tmp_path):
    """With a GPU in the map, accelerate keeps the "cpu" modules' weights in CPU RAM (the modules hold meta
    tensors) and runs them on the main device, cuda:0: their KV blocks, the logits and seeded generators
    belong on cuda:0 too."""
    device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": "cpu", "model.norm": "cpu",
                  "model.rotary_emb": 0, "lm_head": "cpu"}
    original, split = dispatched(tmp_path, device_map)
    assert split.model.layers[1].self_attn.q_proj.weight.device.type == "meta"
    prompts = random_prompts([7, 15])
    expected = [hf_greedy(original, p, 6) for p in prompts]
    generator = paged_hf.ContinuousBatchGenerator(split, PagedConfig(num_blocks=32, block_size=4, attention_backend="torch"))
    cuda = torch.device("cuda", 0)
    assert generator.info.layer_devices == [cuda, cuda]
    assert [k.device for k in generator.runner.cache.key_cache] == [cuda, cuda]
    assert generator.runner.logits_device == cuda
    outputs = generator.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    seeded = generator.generate(prompts[:1], SamplingParams(max_new_tokens=6, seed=1, ignore_eos=True), use_tqdm=False)
    assert len(seeded[0].outputs[0].token_ids) == 6
    assert_no_leak(generator)


def test_offloaded_embedding_and_lm_head_run_on_their_execution_device(tmp_path):
    """accelerate keeps offloaded weights on meta and loads them onto the hook's execution device for each
    forward: inputs, logits and a seeded request's generator belong there, never on meta."""
    device_map = {"model.embed_tokens": "disk", "model.layers.0": "cpu", "model.layers.1": "cpu",
                  "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "disk"}
    original, offloaded = dispatched(tmp_path, device_map)
    assert offloaded.get_output_embeddings().weight.device.type == "meta"
    assert offloaded.get_input_embeddings().weight.device.type == "meta"
    generator = paged_hf.ContinuousBatchGenerator(offloaded, PagedConfig(num_blocks=32, block_size=4))
    assert generator.info.input_device == torch.device("cpu") and generator.runner.logits_device == torch.device("cpu")
    reference = paged_hf.ContinuousBatchGenerator(original, PagedConfig(num_blocks=32, block_size=4))
    prompts = random_prompts([7, 11])
    params = [SamplingParams(max_new_tokens=5, seed=3, ignore_eos=True),
              SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True)]
    outputs = generator.generate(prompts, params, use_tqdm=False)
    expected = reference.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
    assert outputs[1].outputs[0].token_ids == hf_greedy(original, prompts[1], 5)
    assert_no_leak(generator)
