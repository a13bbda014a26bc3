"""Small random float64 models built from configs: argmax ties cannot hide a bug in float64."""

from __future__ import annotations

import copy
import time

import pytest
import torch
import transformers

from paged_hf.loader import default_model as dm

VOCAB = 128

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "mistral_window": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 7}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16, "sliding_window": 6, "attn_logit_softcapping": 5.0}),
}


def tiny_model(family: str = "llama", seed: int = 0, dtype=torch.float64) -> torch.nn.Module:
    config_name, model_name, extra = FAMILIES[family]
    config = getattr(transformers, config_name)(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, **extra,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(dtype).eval()
    model.generation_config.eos_token_id = None  # random models: stop by length unless a test says otherwise
    return model


def real_tokenizer():
    """The default model's tokenizer (49,152 tokens) straight from its GGUF, without loading the model."""
    try:
        folder = dm.default_model_path()
    except RuntimeError as exc:  # pragma: no cover - the test environment installs it
        pytest.skip(str(exc))
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=dm.DEFAULT_GGUF_FILE)


def tiny_model_for(tokenizer, max_position_embeddings: int = 512) -> torch.nn.Module:
    """A tiny random float32 Llama over a real tokenizer's vocabulary (structured outputs need real tokens)."""
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=max_position_embeddings)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    return model


def random_prompts(lengths, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The oracle: plain transformers generate, one prompt at a time."""
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_beam(model, prompt, width, max_new, eos=None, **kwargs):
    """The oracle: HF generate(num_beams=width) on one prompt -> [(generated tokens, sequences_score)]."""
    kwargs.setdefault("num_return_sequences", width)  # the engine's default: every beam
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         num_beams=width, max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=0,
                         return_dict_in_generate=True, output_scores=True, **kwargs)
    result = []
    for row, score in zip(out.sequences, out.sequences_scores.tolist()):
        tokens = row[len(prompt):].tolist()
        ends = [i for i, t in enumerate(tokens) if eos is not None and t in eos]
        result.append((tokens[: ends[0] + 1] if ends else tokens, score))
    return result


@pytest.fixture
def llama():
    return tiny_model("llama")


def assert_no_leak(generator) -> None:
    stats = generator.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"], stats
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0, stats
    assert all(block.ref_count == 0 for block in generator.block_pool.blocks)


# --- the real default model: converted from its GGUF once per test session -------------------------------

@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    """(checkpoint folder, GGUF-loaded model, GGUF tokenizer, seconds the conversion took)."""
    try:
        dm.default_model_path()
    except RuntimeError as exc:  # pragma: no cover - the test environment installs it
        pytest.skip(str(exc))
    target = tmp_path_factory.mktemp("paged_hf_cache") / dm.DEFAULT_MODEL
    captured = {}
    original = dm.load_gguf_model

    def spy(*args, **kwargs):
        captured["model"], captured["tokenizer"] = original(*args, **kwargs)
        return captured["model"], captured["tokenizer"]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dm, "load_gguf_model", spy)
        start = time.perf_counter()
        path = dm.ensure_default_checkpoint(cache_dir=target)
        seconds = time.perf_counter() - start
    print(f"\n[default_model] GGUF -> HF conversion took {seconds:.1f} s")
    assert "model" in captured, "the first ensure_default_checkpoint call did not convert"
    return path, captured["model"], captured["tokenizer"], seconds


@pytest.fixture(scope="session")
def loaded(converted):
    """(model, tokenizer) loaded from the converted checkpoint through load_model."""
    path = converted[0]
    start = time.perf_counter()
    model, tokenizer = dm.load_model(str(path))
    print(f"\n[default_model] reload of the converted checkpoint took {time.perf_counter() - start:.2f} s")
    return model, tokenizer


LORA_CONFIGS = {  # different ranks, alphas, targets; one rsLoRA
    "qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all": dict(r=8, lora_alpha=16, target_modules="all-linear", use_rslora=True),
    "down": dict(r=16, lora_alpha=4, target_modules=["o_proj", "down_proj"]),
}


def make_adapter(base, folder, seed: int, **config):
    """-> the PeftModel (the oracle) after saving it to `folder`."""
    from peft import LoraConfig, get_peft_model  # noqa: PLC0415 - at import time it fails inside pytest's collection

    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(**config))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.3)
    peft_model.save_pretrained(str(folder))
    return peft_model.eval()


def plans_compiled_prefills(kernel) -> bool:
    """Whether the kernel's plan sends a prompt chunk (here 2 tokens, no past) to the compiled prefill kernel;
    otherwise the chunk runs in SDPA, or (float32/float64 compute) in the decode kernel's rows."""
    from paged_hf.kernels.torch_kernel import Query  # noqa: PLC0415

    plan = kernel.plan_queries(torch.tensor([0, 1]), [Query(start=0, length=2, context_len=2, block_table=[0])],
                               torch.device("cpu"))
    return plan.native_prefills is not None


def compare_each_step_both_ways(engine, path=None, switch: str = "enabled", count: str = "layers_served",
                                sequences: list | None = None) -> list[int]:
    """Runs every step's forward twice, through `path` and not (a step writes the same K/V to the same slots either
    way), asserts equal logits bit for bit, and returns what `path` served (its `count`), step by step. `path`: the
    lean layers (by default), their compiled layer (`lean.native`) or another fast path of the runner's
    (`runner.llama_forward`), turned on and off by its `switch`;
    `sequences`: given, each step's number of sequences is appended to it."""
    runner = engine.runner
    path = path or runner.fused_layers.lean
    run, served = runner.run, []

    def both_ways(out):
        setattr(path, switch, False)
        before = getattr(path, count)
        expected, _ = run(out)
        setattr(path, switch, True)
        got, inputs = run(out)
        served.append(getattr(path, count) - before)
        if sequences is not None:
            sequences.append(len(out.scheduled))
        assert torch.equal(got, expected)
        return got, inputs

    runner.run = both_ways
    return served
