"""The torch and CPU kernels against dense attention over each request's whole sequence, on random paged batches."""

from __future__ import annotations

import pytest
import torch

from paged_hf.integrations.transformers import register
from paged_hf.kernels import cpu_kernel
from paged_hf.kernels.selection import select_kernel
from paged_hf.kernels.spec import AttentionSpec, ScoreTerms
from paged_hf.kernels.torch_kernel import TorchKernel
from paged_hf.kernels.cpu_kernel import CpuKernel
from paged_hf.kernels.quant import KVScales
from paged_hf.kernels.torch_kernel import Query
from paged_hf.utils import cpu_flags
from paged_hf.worker.step_inputs import AttentionMetadata


def dense_reference(q, k, v, scaling, window, softcap, distance_bias=None, sinks=None, key_mask=None, alibi=None):
    """q: [query_len, heads, dim] for the last query_len positions of a sequence with K/V k, v: [len, kv, dim];
    distance_bias: [query_len, heads, extent], added to each score by its query-key distance (0 beyond); sinks:
    [query_len, heads], each query's logit in the softmax whose weight is dropped; key_mask: [query_len, len], the
    keys each query may attend besides causality; alibi: [heads] slopes, `-slope * distance` added to each score."""
    query_len, context_len = q.shape[0], k.shape[0]
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    query_pos = torch.arange(context_len - query_len, context_len)[:, None]
    key_pos = torch.arange(context_len)[None, :]
    if alibi is not None:
        scores = scores - alibi[:, None, None] * (query_pos - key_pos)[None]
    if distance_bias is not None:
        for qi, qp in enumerate(query_pos[:, 0].tolist()):
            for kp in range(max(0, qp - distance_bias.shape[-1] + 1), qp + 1):
                scores[:, qi, kp] += distance_bias[qi, :, qp - kp]
    allowed = key_pos <= query_pos
    if window is not None:
        allowed &= key_pos > query_pos - window
    if key_mask is not None:
        allowed &= key_mask
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.T[:, :, None]], dim=-1)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1)[..., :context_len], v)


def check_against_dense(kernel, shapes, *, num_heads, num_kv_heads, head_dim, block_size, dtype, window, softcap,
                        seed, scaling=0.3, bias_extent=None, token_sinks=False, sparse=False, alibi=False):
    """Builds a paged batch of requests with (cached, new) token counts on scattered blocks, writes the new K/V
    through the kernel, attends, and compares every request's rows with dense attention in float64 (with a random
    bias by distance over `bias_extent` distances, random sinks per query token, and a random selection of keys
    per query token that always keeps the query's own, and ALiBi with random slopes, where asked)."""
    torch.manual_seed(seed)
    num_blocks = sum(-(-(past + new) // block_size) for past, new in shapes) + 8
    permutation = torch.randperm(num_blocks).tolist()  # scattered blocks, as after churn
    key_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.float64)
    value_cache = torch.zeros_like(key_cache)
    full_k, full_v, tables, slots, starts, context_lens = [], [], [], [], [0], []
    for past, new in shapes:
        total = past + new
        table = [permutation.pop() for _ in range(-(-total // block_size))]
        k = torch.randn(total, num_kv_heads, head_dim, dtype=torch.float64)
        v = torch.randn_like(k)
        for pos in range(past):  # the past is already in the cache
            key_cache[table[pos // block_size], pos % block_size] = k[pos]
            value_cache[table[pos // block_size], pos % block_size] = v[pos]
        slots += [table[p // block_size] * block_size + p % block_size for p in range(past, total)]
        full_k.append(k), full_v.append(v), tables.append(table), context_lens.append(total)
        starts.append(starts[-1] + new)
    metadata = AttentionMetadata(block_size, starts, context_lens, tables, torch.tensor(slots))
    plan = kernel.plan(metadata, torch.device("cpu"))
    new_k = torch.cat([k[past:] for k, (past, _) in zip(full_k, shapes)])
    new_v = torch.cat([v[past:] for v, (past, _) in zip(full_v, shapes)])
    # the model hands the kernel a transposed (non-contiguous) query, as here
    query = torch.randn(num_heads, starts[-1], head_dim, dtype=torch.float64).transpose(0, 1)
    key_cache, value_cache, new_k, new_v, query = (t.to(dtype) for t in (key_cache, value_cache, new_k, new_v, query))
    kernel.write_kv(new_k, new_v, key_cache, value_cache, plan)
    bias = None if bias_extent is None else torch.randn(starts[-1], num_heads, bias_extent, dtype=torch.float64)
    sinks = torch.randn(starts[-1], num_heads, dtype=torch.float64) if token_sinks else None
    extra = {} if bias is None else {"distance_bias": bias.to(dtype)}
    if sinks is not None:
        extra["sinks"] = sinks.to(dtype)
    slopes = torch.rand(num_heads, dtype=torch.float64) if alibi else None
    if slopes is not None:
        extra["alibi_slopes"] = slopes
    selection = None
    if sparse:  # random keys, each query's own always among them (no query is left with nothing to attend)
        width = max(context_lens)
        own = [n - (starts[i + 1] - t) for i, n in enumerate(context_lens) for t in range(starts[i], starts[i + 1])]
        selection = torch.rand(starts[-1], width) < 0.4
        selection[torch.arange(starts[-1]), torch.tensor(own)] = True
        extra["key_mask"] = selection[:, : width - 3]  # narrower than the longest context: past it, nothing
    out = kernel.attend(query, new_k, new_v, key_cache, value_cache, plan, scaling=scaling, sliding_window=window,
                        softcap=softcap, terms=ScoreTerms(**extra))
    for i in range(len(shapes)):
        rows = slice(starts[i], starts[i + 1])
        k, v = full_k[i], full_v[i]
        if dtype in HALF_TOLERANCE:  # the reference sees the cache's rounded K/V: only the kernel's arithmetic counts
            k, v = k.to(dtype).double(), v.to(dtype).double()
        expected = dense_reference(query[rows].double(), k, v, scaling, window, softcap,
                                   None if bias is None else bias[rows], None if sinks is None else sinks[rows],
                                   None if selection is None else _cut(selection[rows], k.shape[0], width - 3),
                                   slopes)
        tolerance = {torch.float64: 1e-10, torch.float32: 2e-5}.get(dtype) or HALF_TOLERANCE[dtype]
        torch.testing.assert_close(out[rows], expected.to(dtype), rtol=tolerance, atol=tolerance)


def _cut(selection: torch.Tensor, num_keys: int, width: int) -> torch.Tensor:
    """The selection over a request's keys, none at or past `width`."""
    selection = selection[:, :num_keys].clone()
    selection[:, width:] = False
    return selection


#: bf16/fp16 outputs against float64 attention over the same rounded inputs: one rounding of the output (half an
#: ulp: 2^-9 for bf16, 2^-12 for fp16) plus float32 accumulation; a kernel that rounded scores or weights to
#: bf16 on the way would miss these
HALF_TOLERANCE = {torch.bfloat16: 8e-3, torch.float16: 1e-3}


def make_kernel(name: str, dtype, head_dim: int):
    return TorchKernel() if name == "torch" else CpuKernel(dtype, [head_dim])


@pytest.mark.parametrize("window, softcap", [(None, None), (5, None), (None, 20.0), (3, 10.0)])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kernel_name", ["torch", "cpu"])
def test_mixed_prefill_and_decode_batch_matches_dense(kernel_name, window, softcap, seed, dtype):
    # (context already cached, new tokens): fresh prompts, chunks with a past, and decodes
    shapes = [(0, 9), (6, 1), (0, 1), (13, 5), (21, 1), (3, 4), (7, 1)]
    check_against_dense(make_kernel(kernel_name, dtype, 16), shapes, num_heads=4, num_kv_heads=2, head_dim=16,
                        block_size=4, dtype=dtype, window=window, softcap=softcap, seed=seed)


@pytest.mark.parametrize("extent, token_sinks, alibi", [(1, False, False), (3, False, False), (40, False, False),
                                                        (None, True, False), (3, True, False), (None, False, True),
                                                        (3, True, True)])
@pytest.mark.parametrize("window, softcap", [(None, None), (5, 10.0)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_torch_kernel_adds_biases_and_sinks_per_query(extent, token_sinks, alibi, window, softcap, dtype):
    """Inkling's learned relative bias (a logit per query token, head and distance below `extent`), Inkling 2's
    sinks (a logit per query token and head) and ALiBi (BLOOM, MPT): the fresh prompt, the chunk with a past and
    the decodes each take their own rows and positions."""
    shapes = [(0, 9), (6, 1), (0, 1), (13, 5), (21, 1), (3, 4), (7, 1)]
    check_against_dense(TorchKernel(), shapes, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, dtype=dtype,
                        window=window, softcap=softcap, seed=extent or 0, bias_extent=extent, token_sinks=token_sinks,
                        alibi=alibi)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_torch_kernel_attends_only_the_keys_an_indexer_selected(window, dtype):
    """Sparse attention (an indexer's selection per query token): fresh prompts, chunks with a past and decodes."""
    shapes = [(0, 9), (6, 1), (0, 1), (13, 5), (21, 1), (3, 4), (7, 1)]
    check_against_dense(TorchKernel(), shapes, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, dtype=dtype,
                        window=window, softcap=None, seed=3, sparse=True)


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(9, 3, 64), (18, 2, 32), (4, 4, 128), (8, 1, 16)])
@pytest.mark.parametrize("window, softcap", [(None, None), (37, None), (None, 30.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_cpu_kernel_decodes_long_contexts(num_heads, num_kv_heads, head_dim, window, softcap, dtype):
    """Decode rows over many blocks: group sizes from 1 to 9 (past the 8 query heads done at once), a window
    that starts mid-block, last blocks full and partial, and the scale of a real model."""
    shapes = [(past, 1) for past in (0, 15, 16, 47, 300, 511, 129)]
    check_against_dense(make_kernel("cpu", dtype, head_dim), shapes, num_heads=num_heads, num_kv_heads=num_kv_heads,
                        head_dim=head_dim, block_size=16, dtype=dtype, window=window, softcap=softcap, seed=head_dim,
                        scaling=head_dim ** -0.5)


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(9, 3, 64), (18, 2, 32), (50, 1, 16)])
@pytest.mark.parametrize("window, softcap", [(None, None), (37, None), (None, 30.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_cpu_kernel_serves_multi_token_queries(num_heads, num_kv_heads, head_dim, window, softcap, dtype):
    """Multi-token queries (prompt chunks; a request's last token plus its drafts) computed in float32 all go to
    the decode kernel, in tiles of (token, query head) pairs: a prompt over many tiles, a tile boundary inside a
    token's group of heads (9 and 50 query heads per KV head), windows starting mid-block, rows ending in
    different blocks, 2 rows (the fewest a tile takes). float64 sends only queries of up to
    MAX_FLOAT64_QUERY_LEN tokens there, as causal rows; longer ones stay prefill chunks for SDPA."""
    limit = cpu_kernel.MAX_FLOAT64_QUERY_LEN
    shapes = [(300, limit), (47, 5), (0, 100), (511, 2), (15, limit + 1), (130, 1), (29, 3), (33, 17)]
    kernel = make_kernel("cpu", dtype, head_dim)
    kernel.tiles_beat_sdpa = True  # the tiles' arithmetic on any CPU (who takes prompt chunks by default: below)
    starts = [sum(n for _, n in shapes[:i]) for i in range(len(shapes) + 1)]
    metadata = AttentionMetadata(16, starts, [p + n for p, n in shapes], [[0] * -(-(p + n) // 16) for p, n in shapes],
                                 torch.zeros(starts[-1], dtype=torch.long))
    plan = kernel.plan(metadata, torch.device("cpu"))
    native = [n for _, n in shapes if dtype != torch.float64 or n <= limit]
    assert [chunk.query_len for chunk in plan.prefills] == [n for _, n in shapes if n not in native]
    assert plan.decodes.seq_starts.tolist() == [sum(native[:i]) for i in range(len(native) + 1)]
    check_against_dense(kernel, shapes, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                        block_size=16, dtype=dtype, window=window, softcap=softcap, seed=head_dim,
                        scaling=head_dim ** -0.5)


@pytest.mark.parametrize("kv_dtype", [None, torch.int8])
def test_bf16_decode_rows_read_in_place_give_the_float32_calls_bits(kv_dtype):
    """A bf16 step of decodes hands the kernel q rows of the fused q/k/v output (rows further apart than their
    heads): widened and rounded back inside the call, they give the bits of the call on a float32 copy of the
    query (the path a query whose heads are not contiguous takes), whose kernel is checked against dense above."""
    torch.manual_seed(1)
    num_heads, num_kv_heads, head_dim, block_size, num_blocks = 9, 3, 64, 16, 40
    kernel = CpuKernel(torch.bfloat16, [head_dim], kv_dtype)
    cache_dtype = kv_dtype or torch.bfloat16
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if kv_dtype is None:
        key_cache, value_cache, scales = torch.randn(shape).bfloat16(), torch.randn(shape).bfloat16(), None
    else:
        key_cache, value_cache = (torch.randint(-127, 128, shape, dtype=cache_dtype) for _ in range(2))
        scales = KVScales(torch.rand(num_blocks, num_kv_heads) / 50, torch.rand(num_blocks, num_kv_heads) / 50)
    context_lens = [1, 17, 300, 64, 129]
    tables = torch.randperm(num_blocks)[:sum(-(-n // block_size) for n in context_lens)].tolist()
    tables = [[tables.pop() for _ in range(-(-n // block_size))] for n in context_lens]
    metadata = AttentionMetadata(block_size, list(range(len(context_lens) + 1)), context_lens, tables,
                                 torch.zeros(len(context_lens), dtype=torch.long))
    plan = kernel.plan(metadata, torch.device("cpu"))
    fused = torch.randn(len(context_lens), (num_heads + 2 * num_kv_heads) * head_dim).bfloat16()
    query = fused[:, : num_heads * head_dim].view(-1, num_heads, head_dim)  # rows (num_heads + 6) * 64 apart
    heads_apart = query.transpose(0, 1).contiguous().transpose(0, 1)  # the same values, heads not contiguous
    outputs = []
    for q in (query, heads_apart):
        output = q.new_empty(q.shape).contiguous()
        kernel.attend_decodes(q, output, key_cache, value_cache, plan, scaling=head_dim ** -0.5, sliding_window=None,
                              softcap=30.0, scales=scales)
        outputs.append(output)
    assert torch.equal(outputs[0], outputs[1])
    assert outputs[0].abs().sum() > 0


def test_float32_prompt_chunks_go_to_the_tiles_only_on_an_avx512_cpu():
    """Without AVX-512 each 16-float vector of the tiles takes two registers and SDPA is faster for prompt
    chunks; short multi-token queries (a last token and its drafts) stay in the decode kernel's rows."""
    kernel = make_kernel("cpu", torch.float32, 64)
    assert kernel.tiles_beat_sdpa == ("avx512f" in cpu_flags())
    limit = cpu_kernel.MAX_FLOAT64_QUERY_LEN
    queries = [Query(start=0, length=limit, context_len=limit, block_table=[0]),
               Query(start=limit, length=limit + 1, context_len=limit + 1, block_table=[1])]
    for tiles in (True, False):
        kernel.tiles_beat_sdpa = tiles
        plan = kernel.plan_queries(torch.zeros(2 * limit + 1, dtype=torch.long), queries, torch.device("cpu"))
        assert [chunk.query_len for chunk in plan.prefills] == ([] if tiles else [limit + 1])


def specs(dtype: torch.dtype, head_dims: list[int], kv_dtype: torch.dtype | None = None, device: str = "cpu",
          **fields) -> list[AttentionSpec]:
    """One AttentionSpec per head_dim: a model's layers as the model probe describes them."""
    return [AttentionSpec(i, 2, d, d, torch.device(device), dtype, kv_dtype, **fields) for i, d in enumerate(head_dims)]


def test_kernel_selection():
    assert isinstance(select_kernel("auto", specs(torch.float32, [64])), CpuKernel)
    assert type(select_kernel("torch", specs(torch.float32, [64]))) is TorchKernel
    # bf16 and fp16 caches are read by the compiled kernel too (computed in float32: head_dim in 16s)
    assert isinstance(select_kernel("auto", specs(torch.bfloat16, [64])), CpuKernel)
    assert isinstance(select_kernel("auto", specs(torch.float16, [16])), CpuKernel)
    # what the compiled kernel cannot tile falls back to torch under auto, and is refused when asked for
    assert type(select_kernel("auto", specs(torch.float32, [24]))) is TorchKernel
    assert type(select_kernel("auto", specs(torch.bfloat16, [24]))) is TorchKernel
    assert type(select_kernel("auto", specs(torch.float8_e5m2, [64]))) is TorchKernel
    with pytest.raises(ValueError, match="float32/float64/bfloat16/float16"):
        select_kernel("cpu", specs(torch.float8_e5m2, [64]))
    with pytest.raises(ValueError, match="64 bytes of torch.float32"):
        select_kernel("cpu", specs(torch.bfloat16, [24]))
    with pytest.raises(ValueError, match="CUDA"):
        select_kernel("flashinfer", specs(torch.float16, [64]))
    with pytest.raises(ValueError, match="attention_backend"):
        select_kernel("fastest", specs(torch.float32, [64]))


@pytest.mark.parametrize("fields, named", [
    ({"score_terms": frozenset({"sinks"})}, "attention sinks"),
    ({"score_terms": frozenset({"alibi_slopes"})}, "ALiBi"),
    ({"score_terms": frozenset({"distance_bias"})}, "bias by distance"),
    ({"score_terms": frozenset({"key_mask"})}, "keys selected"),
    ({"chunk_size": 8}, "chunked"),
])
def test_what_only_the_torch_kernel_computes_goes_to_it_and_says_why(fields, named):
    """One layer's feature is enough: the compiled kernel refuses the model, naming the feature."""
    layers = specs(torch.float32, [64, 64])
    layers[1] = AttentionSpec(**{**layers[1].__dict__, **fields})
    assert type(select_kernel("auto", layers)) is TorchKernel
    with pytest.raises(ValueError, match=named):
        select_kernel("cpu", layers)


def test_k_and_v_of_different_widths_go_to_the_torch_kernel():
    layers = [AttentionSpec(0, 2, 64, 32, torch.device("cpu"), torch.float32)]  # MLA: V narrower than K
    with pytest.raises(ValueError, match="MLA"):
        select_kernel("cpu", layers)


@pytest.mark.parametrize("broken, message", [
    ("no compiler", "no C\\+\\+ compiler"),
    ("failing compiler", "failed to build"),
    ("unwritable cache", "cannot build or load"),
])
def test_cpu_kernel_that_cannot_be_built_falls_back_to_torch(broken, message, monkeypatch, tmp_path):
    from paged_hf.kernels import native

    monkeypatch.setenv("PAGED_HF_CACHE", str(tmp_path / "cache"))  # nothing cached: a build is needed
    if broken == "no compiler":
        monkeypatch.setenv("CXX", "")
        monkeypatch.setattr(native.shutil, "which", lambda name: None)
    elif broken == "failing compiler":
        monkeypatch.setenv("CXX", "false")  # exists, exits 1
    else:
        (tmp_path / "cache").write_text("a file where the cache folder should be")
    native.load_paged_decode.cache_clear()
    try:
        assert type(select_kernel("auto", specs(torch.float32, [64]))) is TorchKernel
        with pytest.raises(ValueError, match=message):
            select_kernel("cpu", specs(torch.float32, [64]))
    finally:
        native.load_paged_decode.cache_clear()


@pytest.mark.parametrize("family", ["llama", "mistral_window"])
def test_plain_forward_through_paged_hf_equals_sdpa(family):
    """Outside a paged step, the registered attention function is exactly sdpa (padding included)."""
    from conftest import tiny_model

    register()
    model = tiny_model(family)
    input_ids = torch.randint(3, 100, (2, 12))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :4] = 0  # left padding
    model.set_attn_implementation("sdpa")
    expected = model(input_ids=input_ids, attention_mask=attention_mask).logits
    model.set_attn_implementation("paged_hf")
    got = model(input_ids=input_ids, attention_mask=attention_mask).logits
    assert torch.equal(got, expected)


def test_wrap_leaves_the_model_untouched(llama):
    import paged_hf

    input_ids = torch.randint(3, 100, (1, 10))
    before = llama(input_ids=input_ids).logits
    implementation = llama.config._attn_implementation
    wrapped = paged_hf.wrap(llama, num_blocks=16, block_size=4)
    wrapped.generator.generate([[5, 6, 7]], paged_hf.SamplingParams(max_new_tokens=3), use_tqdm=False)
    assert llama.config._attn_implementation == implementation
    assert torch.equal(wrapped(input_ids=input_ids).logits, before)
    assert wrapped.unwrap() is llama and wrapped.config is llama.config and wrapped.device == llama.device
