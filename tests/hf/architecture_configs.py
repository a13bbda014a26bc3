"""Tiny configs for every causal-LM architecture transformers ships: generic field rules, then overrides.

`tiny_config(model_type)` starts from the architecture's default config (`AutoConfig.for_model`) as a dict,
rewrites the fields it knows by name (the same rule for every architecture, and for every sub-config such as
a multimodal wrapper's `text_config`), keeps each layer pattern with the fewest layers that still show every kind
of layer (one sliding and one full, one dense and one MoE, one attention and one SSM layer), and finally applies
the short table in `architecture_overrides.py` where a name alone says too little. The config is rebuilt from
that dict, so the config class's own validation and derived fields run on the tiny values.
"""

from __future__ import annotations

import copy

from transformers import AutoConfig

from architecture_overrides import DEFAULT_KWARGS, OVERRIDES

VOCAB_SIZE = 256
HIDDEN = 64
HEADS = 4
HEAD_DIM = 16
WINDOW = 8  # sliding windows and attention chunks: the sweep's longest prompt crosses them
MAX_POSITIONS = 512
NUM_SPECIAL_IDS = 8  # token ids below this are pad/bos/eos/...: prompts never use them

#: field name -> tiny value, at any level of the config
SIZES = {
    **dict.fromkeys(["hidden_size", "d_model", "n_embd", "embed_dim", "dim", "emb_dim", "backbone_hidden_size",
                     "embedding_dim", "attention_hidden_size", "hidden_size_global", "lru_width", "adapter_in_dim",
                     "adapter_out_dim", "adapter_input_size"], HIDDEN),
    **dict.fromkeys(["intermediate_size", "ffn_dim", "n_inner", "decoder_ffn_dim", "encoder_ffn_dim", "dim_ff",
                     "dense_intermediate_size", "prefix_dense_intermediate_size", "ffn_hidden_size",
                     "intermediate_size_mlp", "feed_forward_size", "d_inner"], 2 * HIDDEN),
    **dict.fromkeys(["moe_intermediate_size", "shared_expert_intermediate_size", "expert_ffn_hidden_size",
                     "moe_shared_expert_intermediate_size", "shared_intermediate_size",
                     "shared_experts_intermediate_size"], 32),
    **dict.fromkeys(["num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads",
                     "num_attention_heads_per_layer",
                     "encoder_attention_heads", "attention_heads", "num_encoder_attention_heads",
                     "num_decoder_attention_heads"], HEADS),
    **dict.fromkeys(["head_dim", "attention_head_dim", "d_head", "dim_head", "kv_channels", "attention_head_size",
                     "swa_head_dim"], HEAD_DIM),
    **dict.fromkeys(["vocab_size", "n_vocab", "unpadded_vocab_size"], VOCAB_SIZE),
    **dict.fromkeys(["max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "context_length",
                     "max_target_positions", "max_source_positions", "model_max_length"], MAX_POSITIONS),
    **dict.fromkeys(["sliding_window", "sliding_window_size", "attention_window_size", "window_size",
                     "attention_chunk_size", "local_attention_window_len", "keep_window_size"], WINDOW),
    **dict.fromkeys(["num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"], 4),
    **dict.fromkeys(["num_experts_per_tok", "moe_topk", "top_k_experts", "num_experts_per_token", "moe_k",
                     "moe_top_k"], 2),
    **dict.fromkeys(["n_shared_experts", "num_shared_experts", "moe_num_shared_experts"], 1),
    **dict.fromkeys(["n_group", "num_expert_group", "topk_group"], 1),
    **dict.fromkeys(["first_k_dense_replace", "num_dense_layers"], 1),
    # MLA: a query/key head is nope + rope dims (8 + 8 = HEAD_DIM), values HEAD_DIM
    "q_lora_rank": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": HEAD_DIM,
    "qk_head_dim": HEAD_DIM, "rotary_dim": 8, "index_head_dim": HEAD_DIM, "index_n_heads": 2, "index_topk": 4,
    "index_block_size": 4, "index_topk_blocks": 2,  # block-sparse attention: short prompts span several blocks
    # linear attention and SSM mixers
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": HEAD_DIM,
    "linear_value_head_dim": HEAD_DIM, "linear_num_heads": 4, "linear_head_dim": HEAD_DIM,
    **dict.fromkeys(["mamba_d_state", "state_size", "ssm_state_size"], 16),
    **dict.fromkeys(["mamba_n_heads", "mamba_num_heads", "n_mamba_heads"], 8),
    **dict.fromkeys(["mamba_d_head", "mamba_head_dim", "mamba_headdim"], HEAD_DIM),
    **dict.fromkeys(["mamba_n_groups", "n_groups", "mamba_ngroups"], 1),
    **dict.fromkeys(["mamba_chunk_size", "chunk_size"], 16),
    **dict.fromkeys(["time_step_rank", "mamba_dt_rank"], 8),
    "mamba_d_ssm": 2 * HIDDEN, "adapter_rank": 8, "laurel_rank": 8, "router_hidden_size": 32,
    "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": VOCAB_SIZE, "encoder_hash_byte_group_vocab": 64,
    "image_size": 32, "patch_size": 8,
}
#: fields some default configs leave None although the model reads them (HF's own default cannot be built)
FILL_NONE = {"head_dim": HEAD_DIM, "num_key_value_heads": 2, "num_experts_per_tok": 2, "n_routed_experts": 4,
             "n_shared_experts": 1}
LAYER_COUNTS = ["num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "encoder_layers",
                "num_decoder_layers", "num_encoder_layers", "num_blocks"]
KV_HEADS = ["num_key_value_heads", "num_kv_heads", "swa_num_key_value_heads"]
TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "sep_token_id": 3, "cls_token_id": 4,
             "mask_token_id": 5, "unk_token_id": 6, "decoder_start_token_id": 1}
#: lists of layer indices (which layers are MoE, full attention, cross-attention, ...)
INDEX_LISTS = ("moe_layers", "full_attn_idxs", "mlp_only_layers", "cross_attention_layers", "hybrid_layer_ids",
               "attn_layer_indices", "global_attn_indexes", "intermediate_layers_indices")
SUB_CONFIGS = ("text_config", "vision_config", "audio_config", "encoder_config", "decoder_config",
               "global_config", "patcher_config", "vq_config", "depth_decoder_config", "audio_encoder_config",
               "attn_config", "ffn_config")


def default_config(model_type: str):
    """The architecture's default config (with `DEFAULT_KWARGS` where transformers' own default is invalid)."""
    return AutoConfig.for_model(model_type, **DEFAULT_KWARGS.get(model_type, {}))


def tiny_config(model_type: str):
    """The architecture's default config shrunk to a tiny model (see the module docstring)."""
    config = default_config(model_type)
    fields = shrink(config.to_dict())
    override = OVERRIDES.get(model_type)
    if override is not None:
        fields = override(fields) if callable(override) else deep_update(fields, override)
    return type(config).from_dict(fields)


def shrink(fields: dict) -> dict:
    """Generic rules on one config dict (sizes by field name, `FILL_NONE`, KV heads, special token ids, layer
    patterns), then on each of its sub-configs."""
    fields = copy.deepcopy(fields)
    old = dict(fields)
    for name, value in SIZES.items():
        current = fields.get(name)
        if isinstance(current, int) and not isinstance(current, bool) and current:
            fields[name] = value
        elif isinstance(current, list) and current and all(type(v) is int for v in current):
            fields[name] = [value] * len(current)  # a per-layer size (Gemma-3n's intermediate_size)
    for name, value in FILL_NONE.items():
        if name in fields and fields[name] is None:
            fields[name] = value
    heads = fields.get("num_attention_heads", fields.get("n_head"))
    for name in KV_HEADS:
        if isinstance(fields.get(name), int):
            fields[name] = kv_heads(fields[name], old.get("num_attention_heads", old.get("n_head")), heads)
    for name, value in TOKEN_IDS.items():
        if fields.get(name) is not None:
            fields[name] = [value] if isinstance(fields[name], list) else value
    keep_dims_consistent(fields, old)
    shrink_layers(fields, old)
    for name in SUB_CONFIGS:
        if isinstance(fields.get(name), dict):
            fields[name] = shrink(fields[name])
    return fields


def kv_heads(default: int, default_heads: int | None, heads: int | None) -> int:
    """Keep the kind of attention: MHA stays MHA, MQA stays MQA, GQA becomes 2 KV heads."""
    if heads is None or default_heads is None or default == default_heads:
        return heads or default
    return 1 if default == 1 else 2


def keep_dims_consistent(fields: dict, old: dict) -> None:
    """Dims that default to another dim follow it: DeepSeek's head_dim is its rope dim, MLA's qk_head_dim is its
    nope + rope dims."""
    if "qk_rope_head_dim" in old and old.get("head_dim") == old["qk_rope_head_dim"]:
        fields["head_dim"] = fields["qk_rope_head_dim"]
    if "qk_head_dim" in old and "qk_nope_head_dim" in old:
        fields["qk_head_dim"] = fields["qk_nope_head_dim"] + fields["qk_rope_head_dim"]


def shrink_layers(fields: dict, old: dict) -> None:
    """The fewest layers that keep every layer pattern: the first layer of each kind in every per-layer list (a
    list as long as the layer count: layer types, flags) and in every `INDEX_LISTS` list (member or not); those
    lists cut to the chosen layers or renumbered, the counts set to match."""
    count = next((fields[name] for name in LAYER_COUNTS if isinstance(fields.get(name), int)), None)
    if count is None or count <= 2:
        return
    per_layer = [name for name, value in fields.items() if isinstance(value, list) and len(value) == count
                 and name not in INDEX_LISTS and not name.endswith("token_id")]
    index_lists = [name for name in INDEX_LISTS if isinstance(fields.get(name), list)]
    patterns = [fields[name] for name in per_layer if is_pattern(fields[name])]
    patterns += [[i in fields[name] for i in range(count)] for name in index_lists]
    chosen = {index for pattern in patterns for index in first_of_each_kind(pattern)}
    chosen = sorted(chosen) if len(chosen) >= 2 else sorted(chosen | {0, 1})[:2]
    for name in per_layer:
        fields[name] = [fields[name][i] for i in chosen]
    for name in index_lists:
        fields[name] = [new for new, index in enumerate(chosen) if index in fields[name]]
    if isinstance(fields.get("per_layer_config"), dict):
        fields["per_layer_config"] = per_layer_overrides(fields["per_layer_config"], chosen, fields, old)
    for name in [*LAYER_COUNTS, "num_kv_shared_layers"]:  # a draft model shares all its layers: still all
        if isinstance(fields.get(name), int) and fields[name] == count:
            fields[name] = len(chosen)


def is_pattern(values: list) -> bool:
    """Layer kinds (names, flags), not sizes."""
    return all(isinstance(v, (str, bool)) or v is None or (type(v) is int and v in (0, 1)) for v in values)


def first_of_each_kind(values: list) -> list[int]:
    first = {}
    for index, value in enumerate(values):
        first.setdefault(value, index)
    return list(first.values())


def per_layer_overrides(overrides: dict, chosen: list[int], fields: dict, old: dict) -> dict:
    """A heterogeneous config's {layer index: field overrides} for the chosen layers, renumbered; an override
    of a size stays larger or smaller than the shrunk global value, as it was against the default one."""
    result = {}
    for new_index, old_index in enumerate(chosen):
        entry = next((v for k, v in overrides.items() if int(k) == old_index), None)
        if entry is not None:
            result[new_index] = {name: relative_size(name, value, fields, old) for name, value in entry.items()}
    return result


def relative_size(name: str, value, fields: dict, old: dict):
    default, tiny = old.get(name), fields.get(name)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (value, default, tiny)):
        return value
    return tiny if value == default else 2 * tiny if value > default else max(1, tiny // 2)


def deep_update(fields: dict, changes: dict) -> dict:
    """`changes` over `fields`; a nested dict updates the sub-config of the same name."""
    fields = copy.deepcopy(fields)
    for name, value in changes.items():
        if isinstance(value, dict) and isinstance(fields.get(name), dict) and name in SUB_CONFIGS:
            fields[name] = deep_update(fields[name], value)
        else:
            fields[name] = value
    return fields
