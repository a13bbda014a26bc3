"""Quantized checkpoints served on their own integers (paged_hf/loader/quantized.py): each format's tensors read
into the quantized linears as the library that wrote them means them, the engine's greedy tokens equal to plain
HF's forward with the reference linears (tiny float64 models: argmax ties cannot hide a bug), and what is not
served refused by name."""

from __future__ import annotations

import json

import pytest
import torch

import paged_hf
from paged_hf.kernels.quant_linear import Int4Linear, Int8Linear, QuantizedLinear
from paged_hf.loader.quant_formats import UnsupportedQuantization
from paged_hf.loader.quantized import describe_linears, load_quantized_model, quantize_model, read_tensors
from paged_hf.worker.fast_paths.decoder_layers import FusedDecoderLayer
from paged_hf.worker.fast_paths.fused_layers import FusedLayers
from tests.conftest import assert_no_leak, hf_greedy, random_prompts
from tests.loader.quant_folders import tiny_llama, write_compressed_tensors, write_gptq_awq

pytest.importorskip("compressed_tensors")

#: folder kind -> (writer, module class, the scheme's name)
FOLDERS = {
    "ct_w8a8": (lambda m, f: write_compressed_tensors(m, f, "W8A8"), Int8Linear, "w8a8"),
    "ct_w8a16": (lambda m, f: write_compressed_tensors(m, f, "W8A16", strategy="channel"), Int8Linear, "w8a16"),
    "ct_w4a16_g32": (lambda m, f: write_compressed_tensors(m, f, "W4A16", group_size=32), Int4Linear, "w4a16"),
    "ct_w4a16_asym_g64": (lambda m, f: write_compressed_tensors(m, f, "W4A16_ASYM", group_size=64), Int4Linear,
                          "w4a16"),
    "gptq_g32": (lambda m, f: write_gptq_awq(m, f, "gptq", 32), Int4Linear, "w4a16"),
    "gptq_v2_asym_g64": (lambda m, f: write_gptq_awq(m, f, "gptq", 64, symmetric=False, fmt="gptq_v2"), Int4Linear,
                         "w4a16"),
    "awq_g32": (lambda m, f: write_gptq_awq(m, f, "awq", 32), Int4Linear, "w4a16"),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    made = {}
    for kind, (writer, _, _) in FOLDERS.items():
        made[kind] = writer(tiny_llama(seed=1), tmp_path_factory.mktemp(kind))
    return made


def _weights(model) -> dict[str, torch.Tensor]:
    return {name: module.weight.detach().double() for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and name != "lm_head"}


def _dense(module: QuantizedLinear) -> torch.Tensor:
    """The float weight the module's reference arithmetic computes with."""
    module.use_kernel = False
    eye = torch.eye(module.in_features)
    bias = 0 if module.bias is None else module.bias.float()
    return (module(eye) - bias).T.double()


@pytest.mark.parametrize("kind", FOLDERS)
def test_each_format_reads_as_its_writer_meant(folders, kind):
    """Every linear becomes the scheme's module, its weight the original within half a quantization step (a
    nibble or a column read in the wrong order is off by whole steps), and nothing is a dense float weight."""
    original = _weights(tiny_llama(seed=1))
    model = load_quantized_model(folders[kind], torch.float32)
    _, module_class, scheme = FOLDERS[kind]
    modules = {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    assert set(modules) == set(original) and type(model.lm_head) is torch.nn.Linear
    for name, module in modules.items():
        assert type(module) is module_class and module.scheme == scheme
        step = original[name].abs().amax() / (7 if module_class is Int4Linear else 127)
        assert (_dense(module) - original[name]).abs().max() <= 0.55 * step, name
    assert not any(p.dim() == 2 and p.shape[0] >= 64 and "proj" in n for n, p in model.named_parameters())


@pytest.mark.parametrize("kind", ["ct_w4a16_asym_g64", "ct_w4a16_g32", "ct_w8a8"])
def test_compressed_tensors_own_decompression_agrees(folders, kind):
    """The library's own decompression of each module's tensors gives the weights the modules compute with."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    folder = folders[kind]
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    scheme = QuantizationScheme(**config["config_groups"]["group_0"])
    compressor = BaseCompressor.load_from_registry(config["format"])
    tensors = read_tensors(folder)
    model = load_quantized_model(folder, torch.float32)
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            own = {key[len(name) + 1:]: value for key, value in tensors.items() if key.startswith(name + ".")}
            expected = compressor.decompress(own, scheme)["weight"].double()
            assert torch.allclose(_dense(module), expected, rtol=1e-6, atol=1e-7), name


@pytest.mark.parametrize("kind", FOLDERS)
def test_engine_equals_hf_with_the_reference_linears(folders, kind):
    """The engine (compiled kernels) and plain HF generate (torch references), float64, token for token."""
    model = load_quantized_model(folders[kind], torch.float64)
    model.generation_config.eos_token_id = None
    prompts = random_prompts([5, 17, 40, 3], seed=2)
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            module.use_kernel = False
    expected = [hf_greedy(model, prompt, 12) for prompt in prompts]
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            module.use_kernel = True
    generator = paged_hf.wrap(model, num_blocks=64, block_size=8, max_num_batched_tokens=24).generator
    outputs = generator.generate(prompts, paged_hf.SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True),
                                 use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert_no_leak(generator)


@pytest.mark.parametrize("kind", ["ct_w8a8", "ct_w4a16_g32", "gptq_v2_asym_g64"])
def test_float32_engine_runs_each_projection_group_in_one_call_and_equals_hf(folders, kind):
    """In float32, q/k/v and gate/up of quantized linears are one stacked call in a step (and the decoder layer the
    fused one around them), the engine equal to HF's generate on the linears one by one. The engine probe computes
    W8A8 as W8A16: a stack built then must follow the linears back to int8 activations."""
    model = load_quantized_model(folders[kind], torch.float32)
    model.generation_config.eos_token_id = None
    prompts = random_prompts([5, 17, 40, 3], seed=2)
    expected = [hf_greedy(model, prompt, 12) for prompt in prompts]
    fused = FusedLayers(model)
    assert len(fused.groups) == 2 * model.config.num_hidden_layers and all(g.quantized for g in fused.groups)
    assert sum(isinstance(stand_in, FusedDecoderLayer) for *_, stand_in in fused.sites) == 2
    generator = paged_hf.wrap(model, num_blocks=64, block_size=8, max_num_batched_tokens=24).generator
    outputs = generator.generate(prompts, paged_hf.SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True),
                                 use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    groups = generator.runner.fused_layers.groups
    assert len(groups) == 4 and all(getattr(group.stack, mode) == getattr(group.linears[0], mode)
                                    for group in groups for mode in group.stack.modes)
    for group in groups:  # the weights are held once: each linear's are rows of its stack's
        storage = group.stack.qweight.untyped_storage().data_ptr()
        assert all(linear.qweight.untyped_storage().data_ptr() == storage for linear in group.linears)
    assert [hf_greedy(model, prompt, 12) for prompt in prompts] == expected  # the model outside a step: unchanged
    assert_no_leak(generator)


def test_at_load_int8_smooths_the_linears_of_one_input_alike_and_runs_them_as_one_call():
    """SmoothQuant's scale is shared by the linears reading one input (from the largest of their weights'
    columns), so q/k/v and gate/up stay one call; the engine (float32) still equals HF's generate."""
    model = tiny_llama(seed=3)
    model.generation_config.eos_token_id = None
    assert quantize_model(model, "int8") == 14
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    q, k, v, o = (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj)
    assert torch.equal(q.input_scale, k.input_scale) and torch.equal(q.input_scale, v.input_scale)
    assert torch.equal(mlp.gate_proj.input_scale, mlp.up_proj.input_scale)
    assert not torch.equal(q.input_scale, o.input_scale) and not torch.equal(q.input_scale, mlp.up_proj.input_scale)
    assert len(FusedLayers(model).groups) == 4
    prompts = random_prompts([9, 30], seed=4)
    expected = [hf_greedy(model, prompt, 10) for prompt in prompts]
    generator = paged_hf.wrap(model, num_blocks=32, block_size=8).generator
    outputs = generator.generate(prompts, paged_hf.SamplingParams(max_new_tokens=10, temperature=0), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected


@pytest.mark.parametrize("quantization, module_class", [("int8", Int8Linear), ("w4a16", Int4Linear),
                                                      ("w4a16_gptq", Int4Linear), ("w4a8", Int4Linear)])
def test_quantization_quantizes_a_float_model_at_wrap(quantization, module_class):
    model = tiny_llama(seed=3, dtype=torch.float64)
    model.generation_config.eos_token_id = None
    reference = tiny_llama(seed=3, dtype=torch.float64)
    head = quantization == "w4a8"  # W4A8's output layer is W8A8
    assert quantize_model(reference, quantization) == 14 + head
    for module in reference.modules():
        if isinstance(module, QuantizedLinear):
            module.use_kernel = False
    prompts = random_prompts([9, 30], seed=4)
    expected = [hf_greedy(reference, prompt, 10) for prompt in prompts]
    pm = paged_hf.wrap(model, quantization=quantization, num_blocks=32, block_size=8)
    assert type(model.lm_head) is (Int8Linear if head else torch.nn.Linear)
    assert type(model.model.embed_tokens) is torch.nn.Embedding
    assert all(type(m) is module_class for n, m in model.named_modules() if n.endswith("proj"))
    expected_schemes = {"int8": "float x1, w8a8 x14", "w4a8": "w4a8 x14, w8a8 x1"}
    assert describe_linears(model) == expected_schemes.get(quantization, "float x1, w4a16 x14")
    outputs = pm.generator.generate(prompts, paged_hf.SamplingParams(max_new_tokens=10, temperature=0),
                                    use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_quantization_field_is_checked():
    with pytest.raises(ValueError, match="quantization"):
        paged_hf.wrap(tiny_llama(), quantization="int4")


def test_the_command_line_flag_reaches_the_engine_config():
    from paged_hf.entrypoints.cli import build_parser
    from paged_hf.entrypoints.cli_args import engine_config

    args = build_parser().parse_args(["generate", "in.jsonl", "--quantization", "w4a16"])
    assert engine_config(args)["quantization"] == "w4a16"
    assert "quantization" not in engine_config(build_parser().parse_args(["generate", "in.jsonl"]))


def _edit_config(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"].update(changes)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("method, changes, named", [
    ("gptq", {"desc_act": True}, "act-order"),
    ("gptq", {"bits": 8}, "8-bit"),
    ("awq", {"version": "gemv"}, "gemv"),
    ("awq", {"zero_point": False}, "zero_point"),
    ("gptq", {"quant_method": "bitsandbytes"}, "bitsandbytes"),
])
def test_gptq_awq_schemes_not_served_are_refused_by_name(tmp_path, method, changes, named):
    folder = write_gptq_awq(tiny_llama(), tmp_path, method, 32)
    _edit_config(folder, **changes)
    with pytest.raises(UnsupportedQuantization, match=named):
        load_quantized_model(folder, torch.float32)


def test_compressed_tensors_schemes_not_served_are_refused_by_name(tmp_path):
    cases = [({"weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}, "float 8-bit"),
             ({"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "actorder": "group"}},
              "act-order"),
             ({"weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
               "input_activations": {"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False}},
              "static|tensor")]
    folder = write_compressed_tensors(tiny_llama(), tmp_path, "W8A8")
    for group, named in cases:
        _edit_config(folder, config_groups={"group_0": {"targets": ["Linear"], **group}})
        with pytest.raises(UnsupportedQuantization, match=named):
            load_quantized_model(folder, torch.float32)
    _edit_config(folder, format="marlin-24")
    with pytest.raises(UnsupportedQuantization, match="marlin-24"):
        load_quantized_model(folder, torch.float32)


def test_int8_at_load_smooths_every_linear_the_same_way_each_time():
    first, second = tiny_llama(seed=3, dtype=torch.float64), tiny_llama(seed=3, dtype=torch.float64)
    quantize_model(first, "int8")
    quantize_model(second, "int8")
    linears = [(n, m) for n, m in first.named_modules() if isinstance(m, QuantizedLinear)]
    assert len(linears) == 14 and all(m.input_scale is not None for _, m in linears)
    again = dict(second.named_modules())
    for name, module in linears:  # a seeded calibration: the same scales and integers on every load
        assert torch.equal(module.input_scale, again[name].input_scale)
        assert torch.equal(module.qweight, again[name].qweight)
