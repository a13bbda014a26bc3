"""`paged-hf serve` start-up: the served name and the banner (the server itself: test_server.py)."""

from __future__ import annotations

import pytest
import torch

uvicorn = pytest.importorskip("uvicorn")

from conftest import tiny_model  # noqa: E402

from paged_hf.entrypoints import cli
from paged_hf.loader import default_model  # noqa: E402
from paged_hf.serving import assembly  # noqa: E402


@pytest.fixture
def served(monkeypatch):
    """Runs `paged-hf serve` on the tiny model up to the server's run(); returns what it would have served."""
    from tiny_server import tiny_tokenizer  # noqa: PLC0415

    monkeypatch.setattr(default_model, "load_model",
                        lambda name, dtype, device: (tiny_model("llama", dtype=torch.float32), tiny_tokenizer()))
    result = {}
    from paged_hf.serving.openai.lifecycle import DrainingServer  # noqa: PLC0415

    monkeypatch.setattr(DrainingServer, "run", lambda self: result.update(app=self.config.app))
    return result


def test_a_model_folder_is_served_under_its_name_not_its_path(served, tmp_path):
    folder = tmp_path / "models" / "my-llama"
    folder.mkdir(parents=True)
    assert cli.main(["serve", "--model", f"{folder}/", "--num-blocks", "8"]) == 0
    assert served["app"].state.ctx.model_name == "my-llama"
    assert assembly.default_served_name("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_the_banner_reports_the_max_model_len_the_kv_cache_holds(served, capsys):
    """8 blocks of 16 tokens hold 128 tokens, though the model knows 512 positions."""
    assert cli.main(["serve", "--num-blocks", "8", "--block-size", "16"]) == 0
    banner = capsys.readouterr().err
    assert "max_model_len 128)" in banner, banner
    assert served["app"].state.ctx.max_model_len == 128


def test_stop_string_bounds_are_engine_flags(served):
    assert cli.main(["serve", "--num-blocks", "8", "--max-stop-strings", "3", "--max-stop-string-chars", "9"]) == 0
    config = served["app"].state.ctx.engine.generator.config
    assert (config.max_stop_strings, config.max_stop_string_chars) == (3, 9)


def test_speculative_config_is_vllms_json_flag(served, capsys):
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    assert cli.main(["serve", "--num-blocks", "8", "--speculative-config", spec]) == 0
    config = served["app"].state.ctx.engine.generator.config.speculative
    assert (config.method, config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max) == \
        ("ngram", 3, 4, 4)
    assert cli.main(["serve", "--num-blocks", "8", "--speculative-config", '{"method": "medusa"}']) != 0
    assert "medusa" in capsys.readouterr().err
