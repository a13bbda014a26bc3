"""The CPU weights moved into 2 MB pages at load (paged_hf.worker.huge_pages): the same values, parameters, ties and
views; memory the kernel really backs with huge pages where it offers them; nothing moved where it does not; a
quantized stack made again over moved rows without a copy; and an engine over moved weights gives transformers'
tokens (float32)."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import hf_greedy, random_prompts

import paged_hf
from paged_hf import SamplingParams
from paged_hf.kernels.quant_linear import Int8Linear, quantize_int8_per_channel, stack_linears
from paged_hf.loader.mapped_weights import file_mappings
from paged_hf.worker import huge_pages
from paged_hf.worker.huge_pages import MIN_BYTES, huge_pages_mode, into_huge_pages

OFFERED = huge_pages_mode() in ("always", "madvise")
needs_huge_pages = pytest.mark.skipif(not OFFERED, reason="this kernel offers no transparent huge pages")


def _model() -> torch.nn.Module:
    """Linears of 256 KB (moved) and a norm-sized weight of 1 KB (left), an embedding tied to the head."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"up": torch.nn.Linear(256, 256), "embed": torch.nn.Embedding(512, 128),
                                 "head": torch.nn.Linear(128, 512, bias=False)})
    model["head"].weight = model["embed"].weight
    model.register_buffer("norm", torch.ones(256))
    return model


def _anon_huge_kb(address: int) -> int:
    """AnonHugePages of this process's mapping that holds `address` (/proc/self/smaps)."""
    inside, size = False, 0
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= address < end
            elif inside and head == "AnonHugePages:":
                size = int(line.split()[1])
    return size


@pytest.mark.parametrize("text,mode", [("always [madvise] never\n", "madvise"), ("[always] madvise never", "always"),
                                       ("always madvise [never]\n", "never"), ("", None)])
def test_the_kernels_setting_is_read_as_it_writes_it(tmp_path, text, mode):
    setting = tmp_path / "enabled"
    setting.write_text(text)
    assert huge_pages_mode(str(setting)) == mode
    assert huge_pages_mode(str(tmp_path / "absent")) is None


@pytest.mark.parametrize("mode", ["madvise", "always"])
def test_moved_weights_keep_their_values_parameters_ties_and_views(mode):
    model = _model()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    parameters = dict(model.named_parameters())
    pointers = {name: tensor.data_ptr() for name, tensor in model.state_dict().items()}
    rows = model["up"].weight[64:128]  # a view of the user's, pointed at the copy too when given
    moved = into_huge_pages([*model.parameters(), *model.buffers(), rows], mode=mode)
    assert moved == 256 * 256 * 4 + 512 * 128 * 4  # each storage of 64 KB or more, once (the tie's too)
    assert dict(model.named_parameters()) == parameters  # the same objects
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    assert model["head"].weight is model["embed"].weight
    assert rows.data_ptr() == model["up"].weight[64:].data_ptr()  # still a view of the weight
    for name in ("up.weight", "embed.weight"):
        assert pointers[name] != model.state_dict()[name].data_ptr()
        assert model.state_dict()[name].data_ptr() % huge_pages.PAGE == 0
    for name in ("up.bias", "norm"):  # under MIN_BYTES: where they were
        assert pointers[name] == model.state_dict()[name].data_ptr()
    assert model["up"].weight.requires_grad and model["up"].weight.grad_fn is None
    out = model["up"](torch.ones(2, 256))
    assert torch.equal(out, torch.nn.functional.linear(torch.ones(2, 256), before["up.weight"], before["up.bias"]))


def test_weights_already_moved_stay_where_they_are():
    """A model wrapped a second time: its weights are in 2 MB pages already, nothing is copied again."""
    model = _model()
    assert into_huge_pages(model.parameters(), mode="madvise") > 0
    pointers = [tensor.data_ptr() for tensor in model.parameters()]
    assert into_huge_pages(model.parameters(), mode="madvise") == 0
    assert [tensor.data_ptr() for tensor in model.parameters()] == pointers


def test_a_weight_that_is_a_view_takes_its_base_along():
    """`pack_int4` gives its weights as views of a [n, k/32, 16] tensor: left behind, that base would hold the old
    memory (a view keeps its base alive)."""
    base = torch.randint(0, 255, (256, 16, 16), dtype=torch.uint8)
    weight = base.reshape(256, 256)
    assert weight._base is base
    old = base.data_ptr()
    into_huge_pages([weight], mode="madvise")
    assert weight._base.data_ptr() == weight.data_ptr() != old
    assert torch.equal(weight._base.reshape(256, 256), weight)


def test_nothing_moves_where_the_kernel_offers_no_huge_pages_or_memory_is_short():
    model = _model()
    pointers = [tensor.data_ptr() for tensor in model.state_dict().values()]
    for mode in ("never", "unknown"):  # (and a kernel without the setting reads as None: the test above)
        assert into_huge_pages(model.parameters(), mode=mode) == 0
    # nor where the copies would need more memory than is free (the largest storage, here: the embedding's 256 KB)
    assert into_huge_pages(model.parameters(), mode="madvise", available=(256 << 10) - 1) == 0
    assert [tensor.data_ptr() for tensor in model.state_dict().values()] == pointers
    assert into_huge_pages(model.parameters(), mode="madvise", available=256 << 10) > 0  # (just enough)


def test_an_inference_tensor_moves_and_a_meta_one_stays():
    with torch.inference_mode():
        inference = torch.randn(256, 128)
    meta = torch.empty(1024, 1024, device="meta")
    expected = inference.clone()
    assert into_huge_pages([inference, meta], mode="madvise") == 256 * 128 * 4
    assert torch.equal(inference, expected) and inference.is_inference()
    assert meta.is_meta


@needs_huge_pages
def test_the_moved_memory_is_backed_by_huge_pages():
    weight = torch.randn(4 << 20)  # 16 MB: at least seven whole 2 MB pages wherever the mapping starts
    into_huge_pages([weight])
    assert _anon_huge_kb(weight.data_ptr()) >= 2048
    assert _anon_huge_kb(torch.randn(4 << 20).data_ptr()) == 0 or huge_pages_mode() == "always"


def test_a_quantized_stack_made_again_over_moved_rows_copies_nothing():
    torch.manual_seed(0)
    linears = [Int8Linear(*quantize_int8_per_channel(torch.randn(n, 256)), None, torch.float32, act_quant=True)
               for n in (256, 128, 128)]
    x = torch.randn(3, 256)
    expected = torch.cat([linear(x) for linear in linears], dim=-1)
    stack = stack_linears(linears)
    into_huge_pages([*stack.buffers(), *(b for linear in linears for b in linear.buffers())], mode="madvise")
    again = stack_linears(linears)
    assert again.qweight.data_ptr() == stack.qweight.data_ptr() == linears[0].qweight.data_ptr()
    assert torch.equal(again(x), expected) and torch.equal(stack(x), expected)


def _llama() -> torch.nn.Module:
    """A float32 Llama whose linears are past MIN_BYTES (its norms are not)."""
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    return model


@needs_huge_pages
def test_an_engine_over_moved_weights_gives_transformers_tokens():
    """The runner moves the linears at load, every step reads them."""
    model = _llama()
    prompts = [[p % 512 for p in prompt] for prompt in random_prompts([7, 12], seed=1)]
    expected = [hf_greedy(model, prompt, 10) for prompt in prompts]
    pointer = model.model.layers[0].mlp.up_proj.weight.data_ptr()
    engine = paged_hf.wrap(model, num_blocks=64).generator
    assert engine.runner.huge_page_bytes >= 2 * 3 * 128 * 256 * 4  # the MLPs' linears at least
    assert model.model.layers[0].mlp.up_proj.weight.data_ptr() != pointer
    assert model.model.layers[0].mlp.up_proj.weight.numel() * 4 >= MIN_BYTES
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=10, temperature=0), use_tqdm=False)
    assert [output.outputs[0].token_ids for output in outputs] == expected


@needs_huge_pages
def test_a_checkpoints_mapping_is_let_go_once_its_weights_moved(tmp_path):
    """A checkpoint loaded in its own dtype reads the file's mapping; the norms, under MIN_BYTES, stay behind when
    the linears move, and would keep every page of the file that was read: they are copied out of it too."""
    _llama().save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()

    def in_files() -> list[str]:
        ranges = file_mappings()
        return [name for name, tensor in model.state_dict().items()
                if any(start <= tensor.data_ptr() < end for start, end in ranges)]

    assert "model.norm.weight" in in_files()  # (what the test is about: the loader mapped the file)
    # the file's pages are the page cache's: their copies need all of their bytes free, not just the largest
    mapped = sum(tensor.nbytes for tensor in model.parameters() if tensor.nbytes >= MIN_BYTES)
    assert into_huge_pages(model.parameters(), mode="madvise", available=mapped - 1) == 0
    assert "model.norm.weight" in in_files()
    paged_hf.wrap(model, num_blocks=16)
    assert in_files() == []
