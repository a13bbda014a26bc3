"""Per-architecture changes where the generic rules of `architecture_configs.py` are not enough: layer patterns
that a config derives from periods or index lists, SSM dims that must multiply out, and fields the default config
leaves unusable. Each entry is merged over the generically shrunk config dict (a nested dict updates the
sub-config of that name), or is a function from that dict to the final one."""

from __future__ import annotations

#: model_type -> kwargs without which transformers' default config fails its own validation
DEFAULT_KWARGS = {
    "gemma4_assistant": {"text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0}},
}

MAMBA = {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_chunk_size": 16, "use_mamba_kernels": False}


def gemma3n(fields: dict) -> dict:
    """KV-shared layers must reuse a layer of their own type: two producers (sliding, full), two consumers."""
    text = fields.get("text_config", fields)
    count = 4
    text.update(num_hidden_layers=count, num_kv_shared_layers=2,
                layer_types=["sliding_attention", "full_attention"] * 2, intermediate_size=[128] * count,
                activation_sparsity_pattern=[0.0] * count)
    return fields


def dots3_note(fields: dict) -> dict:
    """Sliding layers' head_dim is their (per-layer) nope dim + rope dim."""
    text = fields.get("text_config", fields)
    sliding = text["layer_types"].index("sliding_attention")
    text["head_dim"] = text["per_layer_config"][sliding]["qk_nope_head_dim"] + text["qk_rope_head_dim"]
    return fields


OVERRIDES: dict = {
    "bamba": {**MAMBA, "attn_layer_indices": [1]},
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                                                   "mrope_section": [4, 2, 2]}}},
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},  # the default's None clip fails in clamp
    "dots3_note": dots3_note,
    "dots3_note_text": dots3_note,
    # to_dict lists each layer as (attention, mlp) blocks and doubles the counts: 3 layers, one of each stage
    # two indexer heads leave many keys at an index score of exactly 0 (every head's ReLU at 0): a tie whose
    # top-k order differs with the scores' shape, so HF's own full forward and its generate select differently
    "deepseek_v32": {"index_n_heads": 16},
    "dory": {"num_hidden_layers": 6, "n_input_layers": 2, "n_recurrent_layers": 2, "n_output_layers": 2,
             "layer_types": ["sliding_attention", "mlp", "full_attention", "mlp", "sliding_attention", "mlp"]},
    "falcon_h1": {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_ssm": 128, "mamba_d_state": 16,
                  "mamba_chunk_size": 16},
    "gemma3n": gemma3n,
    "gemma3n_text": gemma3n,
    "granitemoehybrid": {**MAMBA, "layer_types": ["mamba", "attention"]},
    # num_hidden_layers counts every attention call: layers per stack x H cycles x (L cycles + 1)
    "hrm_text": {"num_layers_per_stack": 1, "H_cycles": 2, "L_cycles": 1, "num_hidden_layers": 4, "L_bp_cycles": [1]},
    # a relative bias that ends before the prompts do, and the full layers' log scaling of queries and bias on
    "inkling_text": {"rel_extent": 6, "log_scaling_n_floor": 3},
    # and three layers in blocks of two (attention across depth); the looped model loops its middle layer twice
    "inkling2_text": {"rel_extent": 6, "log_scaling_n_floor": 3, "num_hidden_layers": 3,
                      "layer_types": ["hybrid_sliding", "hybrid", "hybrid_sliding"], "n_layers_per_attn_res_block": 2},
    "inkling2_loop_text": {"rel_extent": 6, "log_scaling_n_floor": 3, "num_hidden_layers": 3,
                           "layer_types": ["hybrid_sliding", "hybrid", "hybrid_sliding"],
                           "n_layers_per_attn_res_block": 1, "loop_layer_index_start": 1, "loop_layer_index_end": 2,
                           "loop_num_passes": 2},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1,
              "use_mamba_kernels": False},
    "lfm2": {"layer_types": ["conv", "full_attention"], "full_attn_idxs": [1]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "mamba2": {"num_heads": 8, "head_dim": 16},
    # the default has neither sparse-attention nor dense-MLP layers; the released model has both
    "minimax_m3_vl_text": {"layer_types": ["full_attention", "minimax_m3_sparse"], "mlp_layer_types": ["dense", "sparse"]},
    # one indexer and one layer reading its K/V; the generic shrink keeps the default's 50-layer index lists
    "kolibri1_1": {"num_hidden_layers": 4, "mlp_only_layers": [0], "index_layers": [1],
                   "kv_source_layers": [0, 1, 2, 1], "layer_types": ["sliding_attention", "indexed_attention"] * 2,
                   "index_topk": 8,
                   "index_pool_size": 32, "index_compression": 4, "index_num_heads": 1, "index_num_local_tokens": 2,
                   "index_num_sink_tokens": 1},
    "qwen4_exp": {"text_config": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16,
                                  "indexer_budget": 8, "indexer_compress_ratio": 4}},
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 8,
                       "indexer_compress_ratio": 4},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"], "num_hidden_layers": 2},
    "reformer": {"is_decoder": True, "attn_layers": ["local", "lsh"], "axial_pos_shape": [16, 32],
                 "axial_pos_embds_dim": [16, 48], "local_attn_chunk_length": 8, "lsh_attn_chunk_length": 8},
    "xlstm": {"chunk_size": 64, "qk_dim_factor": 1.0},
    "zaya": {"num_experts_per_tok": 1},
    # two hybrid layers: they share one transformer block (tied weights need a second user)
    "zamba": {"attention_hidden_size": 128, "attention_head_dim": 32, "attn_layer_period": 2, "attn_layer_offset": 1,
              "num_hidden_layers": 4, "layers_block_type": ["linear_attention", "hybrid"] * 2},
    "zamba2": {"attention_hidden_size": 128, "attention_head_dim": 32, "mamba_headdim": 16, "kv_channels": 16,
               "num_query_groups": 4, "hybrid_layer_ids": [1]},
}
