"""A checkpoint's file mapping let go once a quantization at load has replaced its weights
(paged_hf/loader/mapped_weights.py): what stays (embeddings, norms, a tied output layer) is copied into the
process's own memory with the same values and ties, and the file is no longer mapped."""

from __future__ import annotations

import gc
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from paged_hf.loader.mapped_weights import copy_out_of_files, file_mappings
from paged_hf.loader.quantized import quantize_model
from tests.loader.quant_folders import tiny_llama

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")


def _mapped(model: torch.nn.Module) -> list[str]:
    """The names of the model's parameters and buffers that read a file's mapping."""
    ranges = file_mappings()
    return [name for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]
            if any(start <= tensor.data_ptr() < end for start, end in ranges)]


def _file_mapped(path) -> bool:
    gc.collect()
    with open("/proc/self/maps") as maps:
        return str(path) in maps.read()


@pytest.mark.parametrize("quantization", ["int8", "w4a8"])
def test_quantizing_at_load_lets_go_of_the_checkpoint_file(tmp_path, quantization):
    tiny_llama(seed=3, dtype=torch.bfloat16, tie=True).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    if not _mapped(model):
        pytest.skip("this transformers copies the checkpoint's tensors: nothing reads the file's mapping")
    assert _file_mapped(tmp_path / "model.safetensors")
    kept = {name: tensor.clone() for name, tensor in model.named_parameters() if "proj" not in name}
    quantize_model(model, quantization)
    assert _mapped(model) == [] and not _file_mapped(tmp_path / "model.safetensors")
    for name, tensor in model.named_parameters():
        if name in kept:
            assert torch.equal(tensor, kept.pop(name)), name
    assert list(kept) in ([], ["lm_head.weight"])  # w4a8's output layer is its own W8A8 module
    if quantization == "int8":  # the tied output layer still reads the embeddings' one copy
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_tensors_of_the_process_own_memory_are_left_as_they_are():
    model = tiny_llama(seed=5)
    pointers = [tensor.data_ptr() for tensor in model.parameters()]
    assert copy_out_of_files(model) == 0 and [tensor.data_ptr() for tensor in model.parameters()] == pointers
