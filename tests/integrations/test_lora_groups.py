"""Wrapped Linears that read the same input (q/k/v, gate/up) computed together: one kernel call per group.

The engine learns the groups from the first adapter step (which wrappers of one module got the same tensor) and
from then on the first member called computes every member's output. The oracle is peft with one adapter
active (float64); a group whose members stop sharing their input falls back to one call per Linear.
"""

from __future__ import annotations

import torch
from conftest import assert_no_leak, hf_greedy, make_adapter, random_prompts, tiny_model

import paged_hf
from paged_hf import PagedConfig, SamplingParams
from paged_hf.integrations.lora import LoRAContext, LoRAGroup, LoRALinear, LoRARouting, updates_over
from paged_hf.worker.fast_paths import fused_layers


def group_names(generator) -> list[list[str]]:
    manager = generator.runner.lora
    path_of = {id(wrapper): path for path, wrapper in manager.wrappers.items()}
    return sorted(sorted(path_of[id(m)].rsplit(".", 1)[1] for m in g.members) for g in manager.groups)


def test_groups_with_an_unwrapped_sibling_and_rank_zero_slots_match_peft(tmp_path, monkeypatch):
    """'qv' wraps q and v only (k is no wrapper: the group is q/v); 'qkv' adds k, where 'qv' has rank 0; 'mlp'
    targets gate/up/down. Mixed in one batch with base-model requests, each output equals peft's alone. Once the
    groups are known, the fused layers add them to their one packed matmul (no wrapper call per projection)."""
    fused_adds = []

    def counted(installed, bases):
        add = updates_over(installed, bases)
        fused_adds.append(add is not None)
        return add

    monkeypatch.setattr(fused_layers, "updates_over", counted)
    base = tiny_model("llama")
    configs = {"qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
               "qkv": dict(r=8, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"]),
               "mlp": dict(r=6, lora_alpha=12, target_modules=["gate_proj", "up_proj", "down_proj"])}
    oracles = {name: make_adapter(base, tmp_path / name, seed, **config)
               for seed, (name, config) in enumerate(configs.items(), start=7)}
    generator = paged_hf.ContinuousBatchGenerator(base, PagedConfig(
        num_blocks=96, block_size=4, max_num_batched_tokens=24, adapters={"qv": str(tmp_path / "qv")}))
    params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    prompts = random_prompts([9, 14, 5, 11], seed=4)

    def check(adapters):
        outputs = generator.generate(prompts, params, adapters=adapters, use_tqdm=False)
        expected = [hf_greedy(base if a is None else oracles[a], p, 6) for p, a in zip(prompts, adapters)]
        assert [o.outputs[0].token_ids for o in outputs] == expected

    check(["qv", None, "qv", None])
    assert group_names(generator) == [["q_proj", "v_proj"]] * 2  # k_proj has no wrapper
    assert True in fused_adds and False in fused_adds  # the first adapter step's wrappers ran, later ones did not
    generator.load_adapter("qkv", tmp_path / "qkv")
    generator.load_adapter("mlp", tmp_path / "mlp")
    check(["qv", "qkv", None, "mlp"])
    assert group_names(generator) == [["gate_proj", "up_proj"]] * 2 + [["k_proj", "q_proj", "v_proj"]] * 2
    assert fused_adds[-1] is True
    assert_no_leak(generator)


def test_members_called_with_other_inputs_compute_alone():
    """A group whose members stop sharing x: every output is still its own Linear's plus its own update, and the
    group is undone (the members make one call each from then on)."""
    torch.manual_seed(0)
    context = LoRAContext()
    layers = [LoRALinear(torch.nn.Linear(16, n, dtype=torch.float64), context, 3, torch.device("cpu"))
              for n in (16, 8)]
    for layer in layers:
        for slot in (0, 2):
            rank = 2 + slot
            layer.set_slot(slot, (torch.randn(rank, 16, dtype=torch.float64),
                                  torch.randn(rank, layer.base.out_features, dtype=torch.float64)))
    layers[1].set_slot(2, None)  # slot 2's adapter skips the second layer
    group = LoRAGroup(layers)
    for layer in layers:
        layer.group = group
    token_slots = torch.tensor([0, 2, -1, 0, 2])
    context.routing = LoRARouting(token_slots)

    def expected(layer, x):
        y = layer.base(x)
        for t, slot in enumerate(token_slots.tolist()):
            if slot >= 0 and layer.weights.pairs[slot] is not None:
                a, bt = layer.weights.pairs[slot]
                y[t] += bt.T @ (a @ x[t])
        return y

    with torch.inference_mode():
        x1, x2, x3 = torch.randn(3, 5, 16, dtype=torch.float64)
        assert torch.allclose(layers[0](x1), expected(layers[0], x1))  # computes both members
        assert torch.allclose(layers[1](x1), expected(layers[1], x1))  # handed out
        assert torch.allclose(layers[0](x2), expected(layers[0], x2))
        assert torch.allclose(layers[1](x3), expected(layers[1], x3))  # not x2: the group is undone
        assert layers[0].group is None and layers[1].group is None
        assert torch.allclose(layers[0](x3), expected(layers[0], x3))
    context.routing = None
