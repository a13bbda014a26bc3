"""Recognising transformers' code (paged_hf.worker.code_match): hub-kernel functions read through, anything
unknown answered (never raised), and a model whose hub kernels `kernels.kernelize` installed served as those
kernels compute, its fast paths off where its code is no longer transformers' own."""

from __future__ import annotations

import functools
import importlib.metadata

import pytest
import torch
from conftest import hf_greedy, random_prompts, tiny_model
from transformers.models.llama import modeling_llama
from transformers.models.mistral import modeling_mistral

import paged_hf
from paged_hf import SamplingParams
from paged_hf.worker.code_match import plain_function, runs_forward_of, same_code
from paged_hf.worker.fast_paths.fused_layers import FusedAttention, FusedLayers, FusedRMSNorm


def test_copied_functions_are_the_same_code_under_any_wrapping():
    """Mistral's copy of Llama's rotary is the same code whether transformers made it a hub-kernel module (with
    HuggingFace's `kernels` installed) or left it a function; another function is not."""
    llama, mistral = modeling_llama.apply_rotary_pos_emb, modeling_mistral.apply_rotary_pos_emb
    assert plain_function(llama) is not None
    assert same_code(llama, mistral)
    assert same_code(functools.wraps(llama)(lambda *a: llama(*a)), mistral)  # a decorator: compared inside it
    assert not same_code(llama, modeling_llama.rotate_half)


@pytest.mark.parametrize("thing", [None, len, print, 3, "apply_rotary_pos_emb", torch.nn.Linear(2, 2),
                                   functools.partial(modeling_llama.rotate_half), object()])
def test_what_is_not_a_python_function_is_answered_not_raised(thing):
    assert plain_function(thing) is None
    assert not same_code(thing, modeling_llama.rotate_half)


def test_a_wrapper_cycle_is_answered_not_raised():
    def looping():
        pass
    looping.__wrapped__ = looping
    assert plain_function(looping) is None


def test_a_module_with_a_forward_of_its_own_is_not_its_class_code():
    model = tiny_model("llama", dtype=torch.float32)
    norm = model.model.norm
    assert runs_forward_of(norm, modeling_llama.LlamaRMSNorm)
    norm.forward = lambda x: 2 * x  # a user's patch on the instance
    assert not runs_forward_of(norm, modeling_llama.LlamaRMSNorm)


def _scaled_norm_forward(self, hidden_states):
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return 2.0 * self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _backwards_rotary_forward(self, q, k, cos, sin, unsqueeze_dim=1):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    rotate = modeling_llama.rotate_half
    return q * cos - rotate(q) * sin, k * cos - rotate(k) * sin


class _LocalKernel:
    """A kernel repository of `kernels` answered from this file (no hub): `load()` gives the layer class."""

    def __init__(self, name: str, forward):
        self.layer_name = name
        self.layer = type(name, (torch.nn.Module,), {"forward": forward})

    def load(self):
        return self.layer


def test_a_kernelized_model_is_served_as_its_kernels_compute():
    """`kernels.kernelize` puts an RMSNorm and a rotary of its own into the model (as `use_kernels=True` does
    with the hub's): the engine's tokens are the kernelized model's own, and the fused stand-ins, which compute
    transformers' code, stay off where the kernels are."""
    try:
        importlib.metadata.version("kernels")  # HuggingFace's (the checkout's folder of that name is no package)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("HuggingFace's kernels is not installed (transformers < 5.25 does not require it)")
    import kernels  # noqa: PLC0415
    model = tiny_model("llama", dtype=torch.float32)
    prompts = random_prompts([9, 4])
    plain = [hf_greedy(model, prompt, 6) for prompt in prompts]
    mapping = {"RMSNorm": {"cpu": _LocalKernel("ScaledNorm", _scaled_norm_forward)},
               "rotary_pos_emb": {"cpu": _LocalKernel("BackwardsRotary", _backwards_rotary_forward)}}
    with kernels.use_kernel_mapping(mapping):
        kernels.kernelize(model, mode=kernels.Mode.INFERENCE, device="cpu")
    expected = [hf_greedy(model, prompt, 6) for prompt in prompts]
    assert expected != plain  # the kernels change the answer: a fast path computing HF's code would show
    fused = {type(stand_in) for *_, stand_in in FusedLayers(model).sites}
    assert fused and not fused & {FusedRMSNorm, FusedAttention}
    engine = paged_hf.wrap(model, num_blocks=32).generator
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
