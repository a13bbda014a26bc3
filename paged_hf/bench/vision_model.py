"""The vision bench's model: an Idefics3 model of SmolVLM-256M's shape with random weights, and an Idefics3 processor
built offline around the default model's tokenizer (SmolLM2's, which SmolVLM's text model uses).

No hub access on the machines that build this project, so SmolVLM-256M-Instruct's config values are written here
(from its config.json and processor_config.json): a SigLIP vision tower of hidden 768, 12 layers, 12 heads, MLP 3072,
patches of 16 on 512-pixel tiles, pixel shuffle by `scale_factor` 4 (64 rows per tile), and SmolLM2-135M's text model
(the default checkpoint's own config: hidden 576, 30 layers, GQA 9/3 heads) with the image tags added to its
vocabulary. Its processor cuts an image larger than a tile into 512-pixel tiles plus a global view; the bench's images
are at most one tile (`TILE`), so each is one tile of 64 `<image>` tokens (the tower's work per image stays the same
for both systems either way).

`tiny` is the same construction at a toy size, for the bench's own test.
"""

from __future__ import annotations

import torch

#: SmolVLM-256M-Instruct (HuggingFaceTB/SmolVLM-256M-Instruct's config.json), the values that set its shape
SMOLVLM_256M = {
    "vision": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                   image_size=512, patch_size=16),
    "scale_factor": 4,  # 1024 patches per tile -> 64 rows
    "tile": 512,  # the processor's max_image_size longest_edge
    "text": None,  # SmolLM2-135M's: the default checkpoint's config
}
TINY = {
    "vision": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                   patch_size=8),
    "scale_factor": 2,  # 16 patches per tile -> 4 rows
    "tile": 32,
    "text": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
}
VISION_SHAPES = {"smolvlm-256m": SMOLVLM_256M, "tiny": TINY}
IMAGE_TOKEN = "<image>"
#: the Idefics3 processor's tags, SmolVLM's added tokens (rows and columns of up to 4 x 4 tiles)
IMAGE_TAGS = ["<fake_token_around_image>", IMAGE_TOKEN, "<end_of_utterance>", "<global-img>",
              *[f"<row_{r}_col_{c}>" for r in range(1, 5) for c in range(1, 5)]]


def smolvlm_tokenizer():
    """The default model's tokenizer (SmolLM2's) with SmolVLM's image tags added as special tokens."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    from paged_hf.loader.default_model import ensure_default_checkpoint  # noqa: PLC0415

    tokenizer = AutoTokenizer.from_pretrained(ensure_default_checkpoint())
    tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_TAGS})
    return tokenizer


def build_vision_model(shape: str, dtype: torch.dtype, seed: int = 0):
    """-> (model, processor) of `shape` (a key of VISION_SHAPES): random weights (seeded), eval, no EOS (every
    request generates its max_new_tokens in every system)."""
    import transformers  # noqa: PLC0415

    from paged_hf.loader.default_model import ensure_default_checkpoint  # noqa: PLC0415

    spec = VISION_SHAPES[shape]
    tokenizer = smolvlm_tokenizer()
    text = transformers.AutoConfig.from_pretrained(ensure_default_checkpoint()).to_dict()
    text.update(spec["text"] or {})
    text.update(vocab_size=len(tokenizer), tie_word_embeddings=True)
    for key in ("architectures", "dtype", "transformers_version", "model_type"):
        text.pop(key, None)
    config = transformers.Idefics3Config(
        vision_config=transformers.Idefics3VisionConfig(**spec["vision"]), text_config=transformers.LlamaConfig(**text),
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN), scale_factor=spec["scale_factor"],
        tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = transformers.Idefics3ForConditionalGeneration(config).to(dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    tile = spec["tile"]
    image_processor = transformers.Idefics3ImageProcessorPil(
        do_image_splitting=True, size={"longest_edge": tile}, max_image_size={"longest_edge": tile})
    rows = (spec["vision"]["image_size"] // spec["vision"]["patch_size"]) ** 2 // spec["scale_factor"] ** 2
    processor = transformers.Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=rows)
    return model, processor


def tile_size(shape: str) -> int:
    return VISION_SHAPES[shape]["tile"]
