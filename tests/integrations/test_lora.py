"""Multi-LoRA serving: every request gets exactly the tokens of plain peft with its one adapter active.

Adapters are real peft folders (get_peft_model + save_pretrained) with random lora_A and lora_B (peft
initialises B to zero, which would hide every routing bug). The oracle is the PeftModel's own greedy
generate, one prompt at a time.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import LORA_CONFIGS as CONFIGS
from conftest import assert_no_leak, hf_greedy, make_adapter, random_prompts, tiny_model

import paged_hf
from paged_hf import PagedConfig, SamplingParams

MAX_NEW = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(base model, {name: folder}, {name: oracle PeftModel})"""
    base = tiny_model("llama")
    root = tmp_path_factory.mktemp("adapters")
    folders, oracles = {}, {}
    for seed, (name, config) in enumerate(CONFIGS.items(), start=1):
        folders[name] = root / name
        oracles[name] = make_adapter(base, folders[name], seed, **config)
    return base, folders, oracles


def greedy(max_new_tokens: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True)


def expected_tokens(base, oracles, prompts, adapters, max_new_tokens: int = MAX_NEW):
    return [hf_greedy(base if a is None else oracles[a], p, max_new_tokens) for p, a in zip(prompts, adapters)]


def engine(base, **config) -> paged_hf.ContinuousBatchGenerator:
    config = {"num_blocks": 96, "block_size": 4, "max_num_batched_tokens": 24, **config}
    return paged_hf.ContinuousBatchGenerator(base, PagedConfig(**config))


def served(generator, prompts, adapters, max_new_tokens: int = MAX_NEW):
    outputs = generator.generate(prompts, greedy(max_new_tokens), adapters=adapters, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def record_step_adapters(generator) -> list[int]:
    """Spy: the number of distinct adapters of every step."""
    counts = []
    manager = generator.runner.lora
    original = manager.assign_slots

    def spy(adapters):
        counts.append(len({id(a) for a in adapters if a is not None}))
        return original(adapters)

    manager.assign_slots = spy
    return counts


def test_mixed_batch_matches_each_peft_oracle(setup):
    """Base + 3 adapters (ranks 4/8/16, different targets, rsLoRA) in the same packed steps, chunked prefill."""
    base, folders, oracles = setup
    prompts = random_prompts([9, 30, 14, 21, 5, 17, 26, 11], seed=1)
    adapters = [None, "qv", "all", "down", "down", "all", None, "qv"]
    generator = engine(base, adapters={n: str(f) for n, f in folders.items()})
    assert generator.adapter_names() == sorted(CONFIGS)
    counts = record_step_adapters(generator)
    assert served(generator, prompts, adapters) == expected_tokens(base, oracles, prompts, adapters)
    assert max(counts) == 3  # the steps really mixed adapters
    assert_no_leak(generator)


MANY_TARGETS = (["q_proj", "v_proj"], "all-linear", ["o_proj", "down_proj"], ["k_proj", "gate_proj", "up_proj"])


@pytest.mark.parametrize("family,num_adapters", [("llama", 64), ("qwen2", 16), ("phi3", 16)])
def test_many_adapters_in_one_batch_match_peft_alone(family, num_adapters, tmp_path):
    """Up to 64 adapters at once, every request on its own (ranks 4 to 64, four sets of target modules): each
    output equals peft's with that adapter alone. The steps mix all of them (one kernel call per linear)."""
    base = tiny_model(family)
    rank_cycle = [4, 8, 16, 64, 5, 32, 12, 8, 4, 48, 16, 8, 6, 24, 10, 64]
    folders, oracles = {}, {}
    for i in range(num_adapters):
        rank, targets = rank_cycle[i % len(rank_cycle)], MANY_TARGETS[i % len(MANY_TARGETS)]
        if family == "phi3" and isinstance(targets, list):  # phi3 fuses q/k/v and gate/up
            targets = ["qkv_proj", "o_proj"] if i % 2 else ["gate_up_proj", "down_proj"]
        name = f"a{i}"
        folders[name] = tmp_path / name
        oracles[name] = make_adapter(base, folders[name], seed=100 + i, r=rank, lora_alpha=2 * rank,
                                     target_modules=targets)
    prompts = random_prompts([5 + (7 * i) % 23 for i in range(num_adapters)], seed=3)
    adapters = list(folders)
    generator = engine(base, adapters={n: str(f) for n, f in folders.items()}, max_loras=num_adapters,
                       max_lora_rank=64, max_num_seqs=num_adapters, max_num_batched_tokens=1024,
                       num_blocks=12 * num_adapters)
    counts = record_step_adapters(generator)
    assert served(generator, prompts, adapters) == expected_tokens(base, oracles, prompts, adapters)
    assert max(counts) == num_adapters  # one step held every adapter
    assert_no_leak(generator)


def test_runtime_load_unload_through_fewer_slots(setup):
    """3 adapters through 2 device slots: the scheduler never puts more than 2 in a step, LRU swaps."""
    base, folders, oracles = setup
    generator = engine(base, max_loras=2)
    for name, folder in folders.items():
        generator.load_adapter(name, folder)
    counts = record_step_adapters(generator)
    prompts = random_prompts([12, 7, 19, 10, 15, 8], seed=2)
    adapters = ["qv", "all", "down", None, "qv", "down"]
    assert served(generator, prompts, adapters) == expected_tokens(base, oracles, prompts, adapters)
    assert max(counts) == 2 and len(counts) > 0
    generator.unload_adapter("all")
    assert generator.adapter_names() == ["down", "qv"]
    with pytest.raises(ValueError, match="'all'"):
        generator.add_request(prompts[0], greedy(), adapter="all")
    with pytest.raises(ValueError, match="'all'"):
        generator.unload_adapter("all")
    assert served(generator, prompts[:2], ["down", "qv"]) == expected_tokens(base, oracles, prompts[:2], ["down", "qv"])
    lora = generator.runner.lora  # what another thread reads (Ray's routing stats): the two in the slots now
    assert lora.resident_names == {"down", "qv"}
    assert set(lora.resident) == {lora.adapters["down"].version, lora.adapters["qv"].version}  # slots by version
    assert_no_leak(generator)


def broken_folders(root, good):
    """{what: folder} of unusable adapters, all made from the good folder `good`."""
    config = json.loads((good / "adapter_config.json").read_text())
    weights = (good / "adapter_model.safetensors").read_bytes()
    cases = {"missing": (None, None), "bad json": ("{not json", weights),
             "rank 16": (dict(config, r=16), weights), "DoRA": (dict(config, use_dora=True), weights),
             "modules_to_save": (dict(config, modules_to_save=["lm_head"]), weights),
             "non-Linear": (dict(config, target_modules=["embed_tokens"]), weights),
             "not found": (dict(config, target_modules=["no_such_proj"]), weights),
             "no weights": (config, None), "bad weights": (config, b"garbage")}
    folders = {}
    for what, (cfg, data) in cases.items():
        folder = folders[what] = root / what.replace(" ", "_")
        if cfg is None:
            continue
        folder.mkdir()
        (folder / "adapter_config.json").write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
        if data is not None:
            (folder / "adapter_model.safetensors").write_bytes(data)
    return folders


REASONS = {"missing": "not a folder", "bad json": "cannot read", "rank 16": "above max_lora_rank=8", "DoRA": "DoRA",
           "modules_to_save": "modules_to_save", "non-Linear": "only nn.Linear", "not found": "not found",
           "no weights": "neither adapter_model.safetensors", "bad weights": "cannot read the weights"}


def test_broken_adapters_and_unknown_names_raise_and_change_nothing(setup, tmp_path):
    base, folders, oracles = setup
    generator = engine(base, max_lora_rank=8, adapters={"qv": str(folders["qv"])})
    for what, folder in broken_folders(tmp_path, folders["qv"]).items():
        with pytest.raises(ValueError, match="'x'") as error:
            generator.load_adapter("x", folder)
        assert REASONS[what] in str(error.value), (what, error.value)
        assert generator.adapter_names() == ["qv"], what
    with pytest.raises(ValueError, match="rank 16"):
        generator.load_adapter("down", folders["down"])  # r=16 > max_lora_rank=8
    prompt = random_prompts([10], seed=3)[0]
    for bad in ("nope", 3):
        with pytest.raises(ValueError, match="unknown adapter"):
            generator.add_request(prompt, greedy(), adapter=bad)
    with pytest.raises(ValueError, match="'nope'"):
        generator.generate([prompt, prompt], greedy(), adapters=["qv", "nope"], use_tqdm=False)
    assert_no_leak(generator)  # the call's accepted request was aborted
    assert served(generator, [prompt] * 2, ["qv", None]) == expected_tokens(base, oracles, [prompt] * 2, ["qv", None])
    assert_no_leak(generator)


def test_prefix_cache_is_keyed_by_adapter_and_version(setup, tmp_path):
    """Same prompt under base and two adapters: different K/V, each its oracle's tokens. A re-load under the
    same name with other weights gives the new adapter's tokens (the old blocks are never hit)."""
    base, folders, oracles = setup
    generator = engine(base, adapters={"qv": str(folders["qv"]), "all": str(folders["all"])})
    prompt = random_prompts([29], seed=4)[0]
    order = [None, "qv", "all", "qv", None]  # one at a time: every later run could hit the earlier blocks
    for adapter in order:
        assert served(generator, [prompt], [adapter]) == expected_tokens(base, oracles, [prompt], [adapter])
    stats = generator.stats()
    assert stats["prefix_cache_hits"] == 2 * 28  # only the repeats hit (28 = 7 full blocks before the last token)
    generator.load_adapter("qv", folders["down"])  # same name, other weights
    assert served(generator, [prompt], ["qv"]) == expected_tokens(base, oracles, [prompt], ["down"])
    assert generator.stats()["prefix_cache_hits"] == stats["prefix_cache_hits"]
    assert_no_leak(generator)


def test_reload_while_running_keeps_old_weights_for_running_requests(setup):
    base, folders, oracles = setup
    generator = engine(base, adapters={"a": str(folders["qv"])}, max_loras=1)
    prompt = random_prompts([10], seed=5)[0]
    old = generator.add_request(prompt, greedy(), adapter="a")
    generator.step()
    generator.load_adapter("a", folders["all"])
    new = generator.add_request(prompt, greedy(), adapter="a")
    results = {}
    while generator.has_unfinished_requests():
        for output in generator.step():
            results[output.request_id] = output.outputs[0].token_ids
    assert results[old] == expected_tokens(base, oracles, [prompt], ["qv"])[0]
    assert results[new] == expected_tokens(base, oracles, [prompt], ["all"])[0]
    assert_no_leak(generator)


def test_plain_forward_and_unwrap_see_the_original_model(setup):
    base, folders, _ = setup
    ids = torch.tensor([random_prompts([12], seed=6)[0]])
    before = base(ids).logits
    modules_before = [(n, type(m)) for n, m in base.named_modules()]
    wrapped = paged_hf.wrap(base, num_blocks=64, block_size=4, adapters={n: str(f) for n, f in folders.items()})
    wrapped.generator.generate([ids[0].tolist()] * 2, greedy(3), adapters=["all", "down"], use_tqdm=False)
    assert torch.equal(wrapped(ids).logits, before)
    assert torch.equal(base(ids).logits, before)
    assert wrapped.unwrap() is base
    assert [(n, type(m)) for n, m in base.named_modules()] == modules_before


def test_bin_weights_and_parallel_sampling(setup, tmp_path):
    """A .bin adapter (read with weights_only=True) serves the same tokens; n > 1 children share the adapter."""
    from safetensors.torch import load_file  # noqa: PLC0415

    base, folders, oracles = setup
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "adapter_config.json").write_text((folders["down"] / "adapter_config.json").read_text())
    torch.save(load_file(str(folders["down"] / "adapter_model.safetensors")), folder / "adapter_model.bin")
    generator = engine(base, adapters={"down_bin": str(folder)})
    prompt = random_prompts([13], seed=7)[0]
    [output] = generator.generate([prompt], SamplingParams(max_new_tokens=MAX_NEW, temperature=0, ignore_eos=True, n=2),
                                  adapters="down_bin", use_tqdm=False)
    expected = expected_tokens(base, oracles, [prompt], ["down"])[0]
    assert [c.token_ids for c in output.outputs] == [expected, expected]
    assert_no_leak(generator)


def test_peft_model_is_served_by_adapter_name(setup):
    """A PeftModel with two adapters: the engine serves its base model and both adapters by name (peft's own
    layers bypassed in every step, base-only steps included) and a folder adapter on top; outside the engine
    the PeftModel still applies its active adapter."""
    from peft import PeftModel  # noqa: PLC0415

    base, folders, oracles = setup
    peft_model = PeftModel.from_pretrained(copy.deepcopy(base), str(folders["qv"]), adapter_name="qv").eval()
    peft_model.load_adapter(str(folders["down"]), adapter_name="down")
    peft_model.set_adapter("down")
    ids = torch.tensor([random_prompts([11], seed=8)[0]])
    before = peft_model(ids).logits
    wrapped = paged_hf.wrap(peft_model, num_blocks=96, block_size=4, max_num_batched_tokens=24)
    generator = wrapped.generator
    generator.load_adapter("all", folders["all"])
    assert generator.adapter_names() == ["all", "down", "qv"]
    prompts = random_prompts([9, 14, 6, 12], seed=9)
    assert served(generator, prompts[:1], [None]) == expected_tokens(base, oracles, prompts[:1], [None])
    adapters = [None, "qv", "down", "all"]
    assert served(generator, prompts, adapters) == expected_tokens(base, oracles, prompts, adapters)
    assert torch.equal(peft_model(ids).logits, before)
    assert wrapped.unwrap() is peft_model
    drop_in = wrapped.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert torch.equal(drop_in, peft_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                                    max_new_tokens=4, do_sample=False))
    assert_no_leak(generator)


def test_save_random_adapter_round_trips_through_peft(setup, tmp_path):
    """The helper behind examples/multi_lora.py writes a folder that peft itself loads to the same model."""
    from peft import PeftModel  # noqa: PLC0415

    from paged_hf.integrations.peft import save_random_adapter  # noqa: PLC0415

    base, _, _ = setup
    folder = save_random_adapter(base, tmp_path / "random", seed=3, std=0.3, r=4, lora_alpha=8,
                                 target_modules="all-linear")
    oracle = PeftModel.from_pretrained(copy.deepcopy(base), folder).eval()
    generator = engine(base, adapters={"random": folder})
    prompt = random_prompts([10], seed=10)[0]
    got = served(generator, [prompt, prompt], ["random", None])
    assert got == [hf_greedy(oracle, prompt, MAX_NEW), hf_greedy(base, prompt, MAX_NEW)]
    assert got[0] != got[1]


def test_error_inside_a_lora_step_restores_the_model(setup):
    """An exception in the forward of an adapter step: the wrappers come out, the routing is cleared, the
    call's requests are aborted, and the generator keeps serving."""
    base, folders, oracles = setup
    generator = engine(base, adapters={"all": str(folders["all"])})
    modules_before = [(n, type(m)) for n, m in base.named_modules()]

    def fail(*_):
        raise RuntimeError("boom")

    hook = base.model.layers[1].register_forward_pre_hook(fail)
    prompt = random_prompts([10], seed=11)[0]
    with pytest.raises(RuntimeError, match="boom"):
        served(generator, [prompt, prompt], ["all", None])
    hook.remove()
    assert [(n, type(m)) for n, m in base.named_modules()] == modules_before
    assert generator.runner.lora.context.routing is None
    assert_no_leak(generator)
    assert served(generator, [prompt], ["all"]) == expected_tokens(base, oracles, [prompt], ["all"])
    with pytest.raises(ValueError, match="adapters must be a dict"):
        engine(base, adapters=[str(folders["all"])])


def test_a_request_waiting_for_a_slot_lets_others_pass(setup):
    """max_loras=1: while 'qv' runs, a 'down' request waits; the base request behind it is admitted at once.
    The waiting one runs when the slot frees up, and every request gets its oracle's tokens."""
    base, folders, oracles = setup
    generator = engine(base, max_loras=1, adapters={n: str(folders[n]) for n in ("qv", "down")})
    prompts = random_prompts([6, 7, 8], seed=12)
    adapters = ["qv", "down", None]
    ids = [generator.add_request(p, greedy(), adapter=a) for p, a in zip(prompts, adapters)]
    generator.step()
    assert [r.request_id for r in generator.scheduler.running] == [ids[0], ids[2]]
    results = {}
    while generator.has_unfinished_requests():
        for output in generator.step():
            results[output.request_id] = output.outputs[0].token_ids
    assert [results[i] for i in ids] == expected_tokens(base, oracles, prompts, adapters)
    assert_no_leak(generator)


def test_tensor_parallel_models_refuse_adapters(setup):
    _, folders, _ = setup
    sharded = tiny_model("llama")
    sharded._tp_size = 2  # what transformers sets after tp_plan sharding
    generator = engine(sharded)
    with pytest.raises(ValueError, match="tensor-parallel"):
        generator.load_adapter("qv", folders["qv"])
    assert generator.adapter_names() == []
