"""`paged-hf bench --model-shape NAME`: the published architectures' numbers (checked without making weights),
and the default model's own shape built for real and run through the bench, whose systems all load its folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from paged_hf.bench.model_shapes import MODEL_SHAPES, ensure_shape_folder, shape_config, shape_info
from paged_hf.entrypoints import cli

#: the numbers of each published config.json, written out again here (not read from the module's table)
PUBLISHED = {
    "smollm2-135m": dict(model_type="llama", hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, intermediate_size=1536, head_dim=64, rope_theta=100000.0),
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, intermediate_size=4864, head_dim=64, rope_theta=1000000.0),
    "llama-1b": dict(model_type="llama", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, intermediate_size=8192, head_dim=64, rope_theta=500000.0),
    "llama-3.2-3b": dict(model_type="llama", hidden_size=3072, num_hidden_layers=28, num_attention_heads=24,
                         num_key_value_heads=8, intermediate_size=8192, head_dim=128, rope_theta=500000.0),
    "qwen3.5-0.8b": dict(model_type="qwen3_5_text", hidden_size=1024, num_hidden_layers=24, num_attention_heads=8,
                         num_key_value_heads=2, intermediate_size=3584, head_dim=256, rope_theta=10000000.0,
                         linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                         linear_value_head_dim=128, linear_conv_kernel_dim=4),
}
#: parameters with the default tokenizer's 49152-token vocab (tied embeddings): the published count less the
#: published embedding, plus 49152 x hidden (qwen3.5-0.8b: no published count of its text model is known here; its
#: 498,113,344 parameters outside the embedding are this shape's own, counted once when the shape was added)
PARAMS = {"smollm2-135m": 134_515_008, "qwen2.5-0.5b": 401_938_304, "llama-1b": 1_073_809_408,
          "llama-3.2-3b": 2_969_742_336, "qwen3.5-0.8b": 548_444_992}


@pytest.fixture
def default_cache(converted, monkeypatch):
    """The session's converted default model as the cache folder: shapes are built there, not in the user's."""
    monkeypatch.setenv("PAGED_HF_CACHE", str(Path(converted[0]).parent))
    return Path(converted[0]).parent


def test_every_shape_has_its_published_numbers_and_the_default_tokenizers_vocab(loaded, tmp_path):
    tokenizer = loaded[1]
    assert set(MODEL_SHAPES) == set(PUBLISHED)
    for name, numbers in PUBLISHED.items():
        shape_config(name, tokenizer, "bfloat16").save_pretrained(tmp_path / name)
        config = AutoConfig.from_pretrained(tmp_path / name)  # as every system reads it back from config.json
        got = {key: getattr(config, key) for key in numbers if key != "rope_theta"}
        assert got | {"rope_theta": config.rope_parameters["rope_theta"]} == numbers, name
        assert config.vocab_size == len(tokenizer) == 49152 and config.tie_word_embeddings, name
        assert config.dtype == torch.bfloat16 and config.eos_token_id == tokenizer.eos_token_id, name
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        assert sum(p.numel() for p in model.parameters()) == PARAMS[name], name
    llama3 = AutoConfig.from_pretrained(tmp_path / "llama-1b").rope_parameters
    assert llama3["rope_type"] == "llama3" and llama3["factor"] == 32.0
    assert llama3["original_max_position_embeddings"] == 8192
    qwen35 = AutoConfig.from_pretrained(tmp_path / "qwen3.5-0.8b")
    assert qwen35.rope_parameters["partial_rotary_factor"] == 0.25
    assert qwen35.layer_types == ["linear_attention"] * 3 + ["full_attention"] + (["linear_attention"] * 3 +
                                                                                  ["full_attention"]) * 5
    assert MODEL_SHAPES["llama-1b"].published_vocab_size == 128256
    assert MODEL_SHAPES["qwen2.5-0.5b"].published_vocab_size == 151936
    with pytest.raises(ValueError, match="unknown model shape 'llama-9b'; known: smollm2-135m"):
        shape_config("llama-9b", tokenizer)


def test_model_and_model_shape_are_exclusive(converted, default_cache, capsys):
    code = cli.main(["bench", "--model", str(converted[0]), "--model-shape", "llama-1b", "--dtype", "float32"])
    assert code == 2
    assert "--model-shape and --model are exclusive" in capsys.readouterr().err
    assert not (default_cache / "bench_models").exists()  # nothing was built
    with pytest.raises(SystemExit):  # argparse names the known shapes
        cli.main(["bench", "--model-shape", "llama-9b"])
    assert "invalid choice: 'llama-9b'" in capsys.readouterr().err


@pytest.mark.slow
def test_the_default_models_shape_is_built_once_and_runs_through_the_bench(default_cache, tmp_path, capsys):
    out = tmp_path / "out"
    code = cli.main(["bench", "--workload", "decode", "--model-shape", "smollm2-135m", "--requests", "2",
                     "--max-new-tokens-scale", "0.02", "--systems", "paged_hf,hf_static_8", "--threads", "1",
                     "--out", str(out)])
    table = capsys.readouterr().out
    assert code == 0
    folder = default_cache / "bench_models" / "smollm2-135m_float32"
    info = shape_info(folder)
    assert info["name"] == "smollm2-135m" and info["num_params"] == PARAMS["smollm2-135m"]
    config = json.loads((folder / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["dtype"]) == (576, 30, "float32")
    with safe_open(folder / "model.safetensors", "pt") as weights:  # seeded random, std 0.02, not the real model
        std = weights.get_tensor("model.layers.0.mlp.up_proj.weight").std().item()
    assert abs(std - 0.02) < 0.001
    assert (folder / "tokenizer.json").exists() and (folder / "chat_template.jinja").exists()

    report = json.loads((out / "bench_decode_smollm2-135m.json").read_text())  # beside the default model's files
    assert report["settings"]["model_shape"]["name"] == "smollm2-135m"
    assert report["settings"]["model"].startswith("smollm2-135m shape, random weights")
    assert report["systems"]["paged_hf"]["outputs_vs_reference"]["identical"] == 2  # HF loads the same folder
    assert report["machine"]["model"]["num_params"] == PARAMS["smollm2-135m"]  # the limit at the shape's size
    assert "model: smollm2-135m shape, random weights" in table
    assert (out / "bench_decode_smollm2-135m.png").stat().st_size > 0

    weights_time = (folder / "model.safetensors").stat().st_mtime_ns
    assert ensure_shape_folder("smollm2-135m", "float32") == folder  # found again, not rebuilt
    assert (folder / "model.safetensors").stat().st_mtime_ns == weights_time

    # `bench --serve --model-shape` finds the same folder and names the shape (vLLM's interpreter left out here:
    # starting servers is the serve bench's own test's job)
    code = cli.main(["bench", "--serve", "--model-shape", "smollm2-135m", "--serve-systems", "vllm",
                     "--vllm-python", str(tmp_path / "no-vllm" / "python"), "--num-prompts", "2", "--out", str(out)])
    assert code == 0 and "model: smollm2-135m shape" in capsys.readouterr().out
    serve_report = json.loads((out / "serve_bench.json").read_text())
    assert serve_report["settings"]["model_shape"]["folder"] == str(folder)
    assert (folder / "model.safetensors").stat().st_mtime_ns == weights_time
