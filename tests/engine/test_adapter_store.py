"""The adapter store's three levels: folders under `lora_root` served by name, host memory bounded by
`max_cpu_loras` (read again on use), reads off the engine thread, and what a broken or changed folder does.
Every output is compared with peft's, the adapter alone (float64 tiny llama)."""

from __future__ import annotations

import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch
from conftest import LORA_CONFIGS as CONFIGS
from conftest import assert_no_leak, hf_greedy, make_adapter, random_prompts, tiny_model

import paged_hf
from paged_hf import PagedConfig, SamplingParams
from paged_hf.config.groups import LoRAConfig
from paged_hf.engine.adapters import adapter_slots

MAX_NEW = 6


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(base model, the LoRA root holding one folder per CONFIGS entry, {name: oracle PeftModel})"""
    base = tiny_model("llama")
    root = tmp_path_factory.mktemp("lora_root")
    oracles = {name: make_adapter(base, root / name, seed, **config)
               for seed, (name, config) in enumerate(CONFIGS.items(), start=1)}
    return base, root, oracles


def engine(base, root, **config) -> paged_hf.ContinuousBatchGenerator:
    config = {"num_blocks": 96, "block_size": 4, "max_num_batched_tokens": 24, "lora_root": str(root), **config}
    return paged_hf.ContinuousBatchGenerator(base, PagedConfig(**config))


def greedy() -> SamplingParams:
    return SamplingParams(max_new_tokens=MAX_NEW, temperature=0, ignore_eos=True)


def expected(base, oracles, prompts, adapters):
    return [hf_greedy(base if a is None else oracles[a], p, MAX_NEW) for p, a in zip(prompts, adapters)]


def served(generator, prompts, adapters):
    outputs = generator.generate(prompts, greedy(), adapters=adapters, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def run_all(generator) -> dict:
    """Step until every add_request is done -> {request id: its final RequestOutput}."""
    finals = {}
    while generator.has_unfinished_requests():
        for output in generator.step():
            if output.finished:
                finals[output.request_id] = output
    return finals


def test_folders_under_the_root_are_served_by_name_through_fewer_slots_and_host_places(setup):
    """No load call: each name is read on first use; 3 adapters through 2 device slots and 2 host places."""
    base, root, oracles = setup
    generator = engine(base, root, max_loras=2, max_cpu_loras=2)
    assert generator.adapter_names() == []
    prompts = random_prompts([12, 7, 19, 10, 15, 8, 11], seed=2)
    adapters = ["qv", "all", "down", None, "qv", "down", "all"]
    assert served(generator, prompts, adapters) == expected(base, oracles, prompts, adapters)
    stats = generator.stats()
    assert generator.adapter_names() == ["all", "down", "qv"]  # registered by their first use
    assert stats["lora_in_memory"] <= 2 and stats["lora_in_slots"] <= 2
    assert stats["lora_loads"] >= 3 and stats["lora_load_seconds_p99"] > 0
    assert_no_leak(generator)


def test_a_cpu_step_holds_every_adapter_in_host_memory_read_in_place(setup):
    """On a CPU the host copy is the slot: with max_loras 1 and max_cpu_loras 3, three adapters run in the same
    steps, their slots point at the adapters' own tensors (nothing copied), and the outputs are peft's."""
    base, root, oracles = setup
    generator = engine(base, root, max_loras=1, max_cpu_loras=3)
    assert generator.scheduler.max_loras == 3
    prompts = random_prompts([12, 7, 19], seed=5)
    adapters = ["qv", "all", "down"]
    ids = [generator.add_request(p, greedy(), adapter=a) for p, a in zip(prompts, adapters)]
    most_at_once, finals = 0, {}
    while generator.has_unfinished_requests():
        for output in generator.step():
            if output.finished:
                finals[output.request_id] = output
        most_at_once = max(most_at_once, len(generator.stats()["lora_running_adapters"]))
    assert most_at_once == 3
    assert [finals[i].outputs[0].token_ids for i in ids] == expected(base, oracles, prompts, adapters)
    manager = generator.runner.lora
    for adapter in manager.adapters.values():
        slot = manager.resident[adapter.version]
        for path, (a, bt) in adapter.weights.items():
            pair = manager.wrappers[path].weights.pairs[slot]
            assert pair[0] is a and pair[1] is bt
    assert_no_leak(generator)


def test_a_gpu_slot_count_stays_max_loras():
    """Only a model computing on CPU reads adapters in place; elsewhere a step holds max_loras adapters."""
    cpu, gpu = SimpleNamespace(layer_devices=[torch.device("cpu")] * 2), SimpleNamespace(
        layer_devices=[torch.device("cpu"), torch.device("cuda", 0)])
    assert adapter_slots(LoRAConfig(max_loras=2, max_cpu_loras=8), cpu) == 8
    assert adapter_slots(LoRAConfig(max_loras=2, max_cpu_loras=8), gpu) == 2
    assert adapter_slots(LoRAConfig(max_loras=16, max_cpu_loras=8), cpu) == 16
    assert adapter_slots(LoRAConfig(max_loras=2), cpu) == 2  # host memory unbounded: max_loras caps a step


def test_names_that_leave_the_root_or_hold_no_adapter_are_refused(setup, tmp_path):
    base, root, _ = setup
    outside = tmp_path / "outside"
    shutil.copytree(root / "qv", outside)
    inner = tmp_path / "root"
    inner.mkdir()
    (inner / "link").symlink_to(outside, target_is_directory=True)  # a symlink out of the root
    (inner / "empty").mkdir()
    shutil.copytree(root / "qv", inner / "qv")
    generator = engine(base, inner)
    prompt = random_prompts([5], seed=1)[0]
    for name in ("missing", "../outside", str(outside), "link", "empty", "", "."):
        with pytest.raises(ValueError, match="unknown adapter"):
            generator.add_request(prompt, greedy(), adapter=name)
    assert not generator.has_unfinished_requests()
    assert generator.serves_adapter("qv") and not generator.serves_adapter("link")


def test_an_adapter_dropped_from_host_memory_is_read_again_as_the_same_version(setup):
    """Same files, same version: the re-read adapter hits the prefix-cache blocks of its first run."""
    base, root, oracles = setup
    generator = engine(base, root, max_cpu_loras=1, max_loras=1)
    prompt = random_prompts([29], seed=4)[0]
    for adapter in ("qv", "all"):  # "all" pushes "qv" out of host memory
        assert served(generator, [prompt], [adapter]) == expected(base, oracles, [prompt], [adapter])
    hits = generator.stats()["prefix_cache_hits"]
    assert served(generator, [prompt], ["qv"]) == expected(base, oracles, [prompt], ["qv"])
    stats = generator.stats()
    assert stats["lora_loads"] == 3 and stats["lora_in_memory"] == 1
    assert stats["prefix_cache_hits"] == hits + 28  # 7 full blocks before the last token
    assert_no_leak(generator)


def test_a_changed_folder_is_a_new_version_that_never_hits_the_old_blocks(setup, tmp_path):
    """The files under a name change while it is out of host memory: the new weights, none of the old K/V."""
    base, root, oracles = setup
    own_root = tmp_path / "root"
    shutil.copytree(root / "qv", own_root / "x")
    shutil.copytree(root / "all", own_root / "other")
    generator = engine(base, own_root, max_cpu_loras=1, max_loras=1)
    prompt = random_prompts([29], seed=4)[0]
    assert served(generator, [prompt], ["x"]) == expected(base, oracles, [prompt], ["qv"])
    assert served(generator, [prompt], ["other"]) == expected(base, oracles, [prompt], ["all"])  # x leaves memory
    hits = generator.stats()["prefix_cache_hits"]
    shutil.rmtree(own_root / "x")
    shutil.copytree(root / "down", own_root / "x")
    assert served(generator, [prompt], ["x"]) == expected(base, oracles, [prompt], ["down"])
    assert generator.stats()["prefix_cache_hits"] == hits
    assert_no_leak(generator)


def test_a_folder_that_fails_to_read_fails_only_its_requests(setup, tmp_path):
    base, root, oracles = setup
    own_root = tmp_path / "root"
    shutil.copytree(root / "qv", own_root / "good")
    shutil.copytree(root / "qv", own_root / "bad")
    (own_root / "bad" / "adapter_model.safetensors").write_bytes(b"not safetensors")
    generator = engine(base, own_root)
    prompts = random_prompts([9, 13, 7], seed=6)
    ids = [generator.add_request(p, greedy(), adapter=a) for p, a in zip(prompts, ["bad", "good", None])]
    finals = run_all(generator)
    assert "cannot read the weights" in finals[ids[0]].error
    assert [finals[i].outputs[0].token_ids for i in ids[1:]] == expected(base, oracles, prompts[1:], ["qv", None])
    assert generator.adapter_names() == ["bad", "good"]  # registered; a fixed folder would be read again
    assert_no_leak(generator)


def test_aborts_while_the_folder_is_read_leak_nothing(setup):
    base, root, oracles = setup
    generator = engine(base, root, max_loras=1, max_cpu_loras=1)
    prompt = random_prompts([11], seed=7)[0]
    for adapter in ("down", "all"):
        request_id = generator.add_request(prompt, SamplingParams(max_new_tokens=4, n=2), adapter=adapter)
        generator.abort(request_id)
    run_all(generator)
    assert_no_leak(generator)
    assert served(generator, [prompt] * 2, ["down", "all"]) == expected(base, oracles, [prompt] * 2, ["down", "all"])
    assert_no_leak(generator)


def test_a_request_waits_in_the_queue_while_its_adapter_is_read_and_others_step_on(setup):
    """A slow disk (the reads' thread busy until released): the base request runs to the end meanwhile, the
    adapter's request is not scheduled; once the read is done it is bound and served with the adapter."""
    base, root, oracles = setup
    generator = engine(base, root)
    disk = threading.Event()
    generator.adapter_store.executor = ThreadPoolExecutor(1)
    generator.adapter_store.executor.submit(disk.wait, 30)  # the read queues behind this
    prompts = random_prompts([9, 13], seed=8)
    waiting = generator.add_request(prompts[0], greedy(), adapter="down")
    running = generator.add_request(prompts[1], greedy())
    finals = {}
    for _ in range(MAX_NEW + 4):
        finals.update((o.request_id, o) for o in generator.step() if o.finished)
    assert running in finals and waiting not in finals
    [queued] = generator.scheduler.waiting
    assert queued.request_id == waiting and queued.num_computed_tokens == 0 and queued.lora is None
    disk.set()
    finals.update(run_all(generator))
    assert finals[waiting].outputs[0].token_ids == expected(base, oracles, prompts[:1], ["down"])[0]
    assert finals[running].outputs[0].token_ids == expected(base, oracles, prompts[1:], [None])[0]
    assert generator.stats()["lora_wait_seconds_p99"] > 0
    assert_no_leak(generator)
