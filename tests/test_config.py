"""PagedConfig's fields, each declared once (paged_hf/config/groups.py, config/engine.py): flat names fill the groups,
the checks come from the declarations, every field is in docs/api.md, and the `paged-hf` flags made from them
give back the config they spell."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from paged_hf import PagedConfig
from paged_hf.config.engine import DECLARED, GROUPS
from paged_hf.config.flags import add_engine_args, engine_config, engine_flags
from paged_hf.config.groups import CacheConfig

API = Path(__file__).resolve().parent.parent / "docs" / "api.md"


def test_flat_names_fill_the_groups_and_read_back():
    config = PagedConfig(block_size=4, max_num_seqs=8, max_loras=2, max_bad_words=5, fuse_layers=False)
    assert (config.cache.block_size, config.scheduler.max_num_seqs, config.lora.max_loras) == (4, 8, 2)
    assert (config.limits.max_bad_words, config.cpu.fuse_layers) == (5, False)
    assert (config.block_size, config.max_num_seqs, config.max_bad_words) == (4, 8, 5)
    assert set(config.flat()) == set(DECLARED) and config.flat()["max_loras"] == 2


def test_a_whole_group_and_flat_names_over_it():
    config = PagedConfig(cache=CacheConfig(block_size=8, num_blocks=12), num_blocks=20)
    assert (config.block_size, config.num_blocks) == (8, 20)


def test_replace_checks_again_and_keeps_the_rest():
    config = PagedConfig(block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    changed = config.replace(enable_prefix_caching=False)
    assert (changed.enable_prefix_caching, changed.block_size, config.enable_prefix_caching) == (False, 4, True)
    with pytest.raises(ValueError, match="max_num_batched_tokens=4 is smaller than max_num_seqs=8"):
        config.replace(max_num_batched_tokens=4)


@pytest.mark.parametrize("field, value, message", [
    ("block_size", 0, "block_size must be an int >= 1, got 0"),
    ("num_blocks", True, "num_blocks must be an int >= 1 or None, got True"),
    ("kv_cache_memory", -1, "kv_cache_memory must be bytes or a fraction"),
    ("kv_cache_dtype", "fp16", "kv_cache_dtype must be one of"),
    ("attention_backend", "fastest", "attention_backend must be one of"),
    ("scheduling_policy", "lottery", "scheduling_policy must be one of"),
    ("tenant_weights", {"a": 0}, "tenant_weights must be a dict"),
    ("max_stream_gap_s", 0, "max_stream_gap_s must be a number of seconds > 0"),
    ("grammar_compile_timeout_s", -1.0, "grammar_compile_timeout_s must be a number of seconds > 0"),
    ("kv_offloading_size", -2, "kv_offloading_size must be a number of GiB >= 0"),
    ("kv_cache_dir", "", "kv_cache_dir must be a non-empty string"),
    ("fuse_layers", "yes", "fuse_layers must be True or False"),
    ("quantization", "int4", "quantization must be None or one of"),
    ("adapters", ["a"], "adapters must be a dict"),
    ("no_such_field", 1, "unknown PagedConfig field"),
])
def test_a_value_out_of_bounds_is_a_value_error_naming_the_field(field, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        PagedConfig(**{field: value})


def test_every_field_is_declared_with_help_and_documented():
    documented = set(re.findall(r"^\| `(\w+)` \|", API.read_text(), flags=re.MULTILINE))
    assert set(DECLARED) <= documented, sorted(set(DECLARED) - documented)
    assert all(field.metadata.get("help") for _, field in DECLARED.values())
    assert {group for group, _ in DECLARED.values()} == {*GROUPS, None}


def test_the_flags_spell_the_config_they_give():
    """Parsing the flags that `engine_flags` writes for a config gives that config back, for every flagged field."""
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = {"block_size": 4, "num_blocks": 40, "kv_cache_memory": 2_000_000_000, "max_model_len": 256,
              "enable_prefix_caching": False, "kv_cache_dtype": "int8", "kv_offloading_size": 1.5,
              "kv_cache_dir": "/tmp/blocks", "kv_cache_dir_size": 2.0, "encoder_cache_bytes": 1 << 20,
              "max_num_batched_tokens": 64, "max_num_seqs": 8,
              "scheduling_policy": "fair", "tenant_weights": {"a": 2.0, "b": 0.5}, "max_stream_gap_s": 0.25,
              "adapters": {"x": "/adapters/x", "y": "/adapters/y"}, "max_loras": 2, "max_lora_rank": 16,
              "max_cpu_loras": 3, "lora_root": "/adapters", "max_stop_strings": 3, "max_stop_string_chars": 9,
              "max_grammar_bytes": 100, "max_grammar_depth": 5, "grammar_compile_timeout_s": 2.5,
              "grammar_cache_bytes": 1000, "max_bad_words": 7, "max_logprobs": 30, "quantization": "w4a16",
              "speculative": dataclasses.asdict(PagedConfig(speculative={"method": "ngram"}).speculative)}
    flagged = {name for name, (_, field) in DECLARED.items() if field.metadata["flags"]}
    assert set(config) == flagged - {"kv_transfer_config"}  # (its own test: tests/serving/test_disaggregated.py)
    assert engine_config(parser.parse_args(engine_flags(config))) == config
    assert PagedConfig(**config).kv_cache_dtype == "int8"


def test_a_field_without_a_flag_cannot_reach_a_server():
    with pytest.raises(ValueError, match="fuse_layers: no `paged-hf serve` flag"):
        engine_flags({"fuse_layers": False})
