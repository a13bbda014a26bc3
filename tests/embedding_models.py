"""Tiny random embedding models saved as sentence-transformers folders, built by sentence-transformers itself:
what the embedding tests compare paged_hf against."""

from __future__ import annotations

import torch
import transformers
from tiny_server import WORDS, tiny_tokenizer

#: texts of 1 to 40 words (a 40-token prompt runs over several chunked-prefill steps of 16 tokens)
TEXTS = [" ".join(WORDS[i:i + n]) for i, n in [(0, 3), (5, 40), (20, 17), (50, 1), (0, 20)]]


def plain_text_tokenizer():
    """The tiny tokenizer without a chat template: sentence-transformers >= 6 would render texts through one."""
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = None
    return tokenizer


def save_embedding_model(folder, pooling_mode: str, normalize: bool = True, seed: int = 0):
    """A tiny float32 Llama + a sentence-transformers Pooling (and Normalize) config, saved by
    sentence-transformers into `folder` -> the SentenceTransformer (the oracle)."""
    from sentence_transformers import SentenceTransformer  # noqa: PLC0415
    from sentence_transformers.sentence_transformer import modules as models  # noqa: PLC0415

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      tie_word_embeddings=True)
    torch.manual_seed(seed)
    lm_folder = folder.parent / f"{folder.name}-lm"
    transformers.LlamaForCausalLM(config).save_pretrained(lm_folder)
    plain_text_tokenizer().save_pretrained(lm_folder)
    transformer = models.Transformer(str(lm_folder))
    modules = [transformer, models.Pooling(64, pooling_mode=pooling_mode)] + ([models.Normalize()] if normalize else [])
    oracle = SentenceTransformer(modules=modules, device="cpu")
    oracle.save(str(folder))
    return oracle
