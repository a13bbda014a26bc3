"""A scripted model: a real LlamaForCausalLM whose weights make it a bigram table, so that the real engine and
server run a model that writes a chosen output (a thinking model's `<think>...</think>`, a tool-call format's
exact text) after a chosen prompt word. What the server tests of output formats share."""

from __future__ import annotations

import re

import torch

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]


def scripted_tokenizer(words: list[str], chat_template: str, exact: bool = False, specials: tuple[str, ...] = ()):
    """A word-level tokenizer over SPECIALS + `words`. Default: words split at whitespace, decoded joined by
    spaces. `exact`: the text is cut at the words wherever they are (a word may hold spaces and newlines) and
    decoded as written, so a word can be a whole tool call in a model's format. `specials`: words that are
    special tokens (left out of a decode that skips them), as a format's markers are in its model's tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(dict.fromkeys(SPECIALS + words))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    if exact:
        pattern = "|".join(re.escape(word) for word in sorted(vocab, key=len, reverse=True))
        backend.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
        backend.decoder = decoders.Fuse()
    else:
        backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>", pad_token="<pad>",
                                        additional_special_tokens=list(specials))
    tokenizer.chat_template = chat_template
    return tokenizer


def scripted_model(tokenizer, script: dict[str, str]) -> torch.nn.Module:
    """`script`: word -> the word written after it (any other token is followed by </s>). Its layers add nothing
    (zero output projections), so the final norm sees the token's one-hot embedding, and the head's column for
    that token points at the next word."""
    import transformers

    size = -(-len(tokenizer) // 8) * 8  # the vocabulary, and the hidden size (one-hot embeddings)
    config = transformers.LlamaConfig(vocab_size=size, hidden_size=size, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).eval()
    head = torch.zeros(size, size)
    head[tokenizer.eos_token_id, :] = 1.0
    for word, following in script.items():
        token = tokenizer.convert_tokens_to_ids(word)
        head[:, token] = 0.0
        head[tokenizer.convert_tokens_to_ids(following), token] = 1.0
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.eye(size))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.copy_(head)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model
