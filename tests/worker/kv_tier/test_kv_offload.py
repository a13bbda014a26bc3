"""The KV tier end to end on tiny float64 models: blocks the pool drops (host memory) or computed (a directory)
come back as prefix hits with HF's greedy tokens; a restarted engine hits the directory; another model, dtype,
block size, KV cache dtype, adapter or salt never does; bad files are skipped; the directory keeps its cap."""

from __future__ import annotations

import argparse
import os

import pytest
import torch
from conftest import LORA_CONFIGS, assert_no_leak, hf_greedy, make_adapter, random_prompts, tiny_model

import paged_hf
from paged_hf import PagedConfig, SamplingParams
from paged_hf.core.request import Request
from paged_hf.entrypoints.cli_args import add_engine_args, engine_config
from paged_hf.serving.openai.metrics import ServerMetrics

BLOCK = 4
GIB = 1 << 30
NUM_NEW = 5


def greedy() -> SamplingParams:
    return SamplingParams(max_new_tokens=NUM_NEW, temperature=0, ignore_eos=True)


def engine(model, **config) -> paged_hf.ContinuousBatchGenerator:
    return paged_hf.ContinuousBatchGenerator(model, PagedConfig(**{"block_size": BLOCK, "num_blocks": 24, **config}))


def run(gen, prompts, **kwargs) -> list[list[int]]:
    outs = gen.generate(prompts, greedy(), use_tqdm=False, **kwargs)
    return [o.outputs[0].token_ids for o in outs]


def landed(gen) -> None:
    """Wait for the writer thread: the files are on disk."""
    assert gen.runner.kv_offload.store.disk.flush(timeout=30)


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def prompts():
    return random_prompts([41, 37, 45], seed=3)  # ~10 blocks each: three do not fit a 24-block pool together


@pytest.fixture(scope="module")
def expected(llama, prompts):
    return [hf_greedy(llama, p, NUM_NEW) for p in prompts]


@pytest.fixture(scope="module")
def filled_dir(tmp_path_factory, llama, prompts, expected):
    """A directory the engine wrote every prompt's blocks to."""
    folder = tmp_path_factory.mktemp("kv")
    gen = engine(llama, kv_cache_dir=str(folder))
    assert run(gen, prompts) == expected
    landed(gen)
    return folder


def test_dropped_blocks_come_back_from_host_memory(llama, prompts, expected):
    gen = engine(llama, kv_offloading_size=0.01, max_num_seqs=1)
    assert run(gen, prompts) == expected
    assert run(gen, prompts) == expected  # each prompt's blocks were dropped for the next prompt's
    stats = gen.stats()
    assert stats["kv_tier_hits"] >= 2 * 9 * BLOCK and stats["kv_tier_host_bytes"] > 0, stats
    assert_no_leak(gen)
    plain = engine(llama, max_num_seqs=1)
    run(plain, prompts)
    run(plain, prompts)
    assert stats["prefix_cache_hits"] > plain.stats()["prefix_cache_hits"]


def test_a_restarted_engine_hits_the_directory(llama, prompts, expected, filled_dir):
    files = sorted(os.listdir(filled_dir))
    assert len(files) == sum((len(p) + NUM_NEW - 1) // BLOCK for p in prompts)  # generated tokens' blocks too
    assert all(f.endswith(".safetensors") for f in files)
    gen = engine(tiny_model("llama"), kv_cache_dir=str(filled_dir))  # a new process would load the same weights
    assert run(gen, prompts) == expected
    stats = gen.stats()
    assert stats["kv_tier_hits"] == sum((len(p) - 1) // BLOCK * BLOCK for p in prompts), stats
    assert stats["kv_tier_disk_reads"] > 0 and stats["kv_tier_bytes_read"] > 0 and stats["kv_tier_bad_files"] == 0
    assert_no_leak(gen)


@pytest.mark.parametrize("change", [
    dict(seed=1), dict(dtype=torch.float32), dict(block_size=8), dict(kv_cache_dtype="int8"), dict(cache_salt="x"),
])
def test_nothing_else_hits_the_directory(filled_dir, prompts, change):
    model = tiny_model("llama", seed=change.get("seed", 0), dtype=change.get("dtype", torch.float64))
    config = {k: v for k, v in change.items() if k in ("block_size", "kv_cache_dtype")}
    gen = engine(model, kv_cache_dir=str(filled_dir), **config)
    gen.add_request(prompts[0], SamplingParams(max_new_tokens=1), cache_salt=change.get("cache_salt"))
    while gen.has_unfinished_requests():
        gen.step()
    stats = gen.stats()
    assert stats["kv_tier_hits"] == 0 and stats["kv_tier_bad_files"] == 0, stats


def test_an_adapter_hits_only_its_own_blocks_after_a_restart(tmp_path, llama, prompts):
    folder = str(tmp_path / "qv")
    make_adapter(llama, folder, seed=5, **LORA_CONFIGS["qv"])
    gen = engine(llama, kv_cache_dir=str(tmp_path / "kv"), adapters={"qv": folder})
    with_adapter = run(gen, prompts[:1], adapters="qv")
    landed(gen)
    again = engine(llama, kv_cache_dir=str(tmp_path / "kv"), adapters={"qv": folder})
    run(again, prompts[:1])  # the base model: none of the adapter's blocks
    assert again.stats()["kv_tier_hits"] == 0
    assert run(again, prompts[:1], adapters="qv") == with_adapter  # the same adapter content: hits
    assert again.stats()["kv_tier_hits"] > 0


def test_bad_files_are_skipped_and_recomputed(tmp_path, llama, prompts, expected):
    gen = engine(llama, kv_cache_dir=str(tmp_path))
    run(gen, prompts[:1])
    landed(gen)
    keys = gen.runner.kv_tier.block_keys(Request("r", 0, prompts[0], greedy()))
    files = [tmp_path / f"{key.hex()}.safetensors" for key in keys]  # the prompt's blocks, first to last
    data = files[0].read_bytes()
    files[0].write_bytes(data[: len(data) // 2])  # truncated
    files[1].write_bytes(os.urandom(len(data)))  # overwritten with random bytes
    flipped = bytearray(files[2].read_bytes())
    flipped[-3] ^= 0xFF  # one byte of K/V changed: only the checksum sees it
    files[2].write_bytes(bytes(flipped))
    files[3].write_bytes(files[4].read_bytes())  # another block's file under this name
    for num_bad in range(1, 5):  # each restart finds the next bad block, recomputes from there and writes it anew
        gen = engine(llama, kv_cache_dir=str(tmp_path))
        assert run(gen, prompts[:1]) == expected[:1]
        stats = gen.stats()
        assert stats["kv_tier_bad_files"] == 1 and stats["kv_tier_hits"] == (num_bad - 1) * BLOCK, stats
        landed(gen)
    gen = engine(llama, kv_cache_dir=str(tmp_path))
    assert run(gen, prompts[:1]) == expected[:1]
    assert gen.stats()["kv_tier_hits"] == (len(prompts[0]) - 1) // BLOCK * BLOCK


def test_the_directory_stays_within_its_bytes(tmp_path, llama, prompts, expected):
    cap = 0.00004 * GIB  # ~43 KB: ~9 block files of ~4.5 KB, fewer than one prompt has
    gen = engine(llama, kv_cache_dir=str(tmp_path), kv_cache_dir_size=cap / GIB)
    assert run(gen, prompts) == expected
    landed(gen)
    sizes = [p.stat().st_size for p in tmp_path.iterdir()]
    assert 0 < len(sizes) < len(prompts[0]) // BLOCK and sum(sizes) <= cap
    smaller = engine(llama, kv_cache_dir=str(tmp_path), kv_cache_dir_size=cap / 2 / GIB)  # a smaller cap at start
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) <= cap / 2
    assert run(smaller, prompts) == expected


def test_config_checks():
    with pytest.raises(ValueError, match="kv_offloading_size"):
        PagedConfig(kv_offloading_size=-1)
    with pytest.raises(ValueError, match="kv_cache_dir"):
        PagedConfig(kv_cache_dir="")
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        engine(tiny_model("llama"), kv_offloading_size=0.01, enable_prefix_caching=False)


def test_a_quantized_cache_round_trips_with_its_scales(tmp_path, llama, prompts):
    cold = engine(llama, kv_cache_dtype="int8", kv_cache_dir=str(tmp_path))
    outputs = run(cold, prompts[:2])
    landed(cold)
    warm = engine(llama, kv_cache_dtype="int8", kv_cache_dir=str(tmp_path))
    assert run(warm, prompts[:2]) == outputs  # the same K/V and scales as computed: the same tokens
    assert warm.stats()["kv_tier_hits"] == sum((len(p) - 1) // BLOCK * BLOCK for p in prompts[:2])


def test_flags_and_metrics(tmp_path, llama, prompts):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--kv-offloading-size", "0.5", "--kv-cache-dir", str(tmp_path),
                              "--kv-cache-dir-size", "2"])
    config = engine_config(args)
    assert config == {"kv_offloading_size": 0.5, "kv_cache_dir": str(tmp_path), "kv_cache_dir_size": 2.0}
    gen = engine(llama, **config)
    run(gen, prompts[:1])
    text = ServerMetrics().render(gen.stats(), 0)
    assert "paged_hf_external_prefix_cache_queries_total " in text and "paged_hf_kv_tier_disk_bytes " in text


def test_a_mixed_workload_with_preemptions_and_forks_is_unchanged(tmp_path, llama):
    """Shared prefixes of different lengths, n=2 children, a pool small enough to preempt: with the tier the
    tokens are those of the engine without it, and nothing leaks."""
    bases = random_prompts([30, 45, 22], seed=7)
    prompts = [bases[i % 3][: 8 + 5 * i] + tail for i, tail in enumerate(random_prompts([3, 9, 1, 6] * 3, seed=8))]
    params = [SamplingParams(max_new_tokens=2 + i % 5, temperature=0, ignore_eos=True, n=1 + i % 2)
              for i in range(len(prompts))]

    def outputs(**config):
        gen = engine(llama, num_blocks=20, max_num_seqs=4, **config)
        outs = []
        for start in range(0, len(prompts), 4):  # in waves: later waves find earlier ones' blocks dropped
            outs += gen.generate(prompts[start : start + 4], params[start : start + 4], use_tqdm=False)
        assert_no_leak(gen)
        return [[c.token_ids for c in out.outputs] for out in outs], gen.stats()

    expected, _ = outputs()
    got, stats = outputs(kv_offloading_size=0.0005, kv_cache_dir=str(tmp_path))
    assert got == expected and stats["kv_tier_hits"] > 0 and stats["num_preemptions"] > 0, stats
