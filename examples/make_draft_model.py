"""Make a draft model for speculative decoding (`{"method": "draft_model", "model": OUT}`): the first N decoder
layers of a model, with its embeddings, final norm and LM head (an early-exit copy: same tokenizer, same
vocabulary, N / num_layers of the layers' cost). Untrained as a draft, so its guesses are what the first
layers already know: of the default model's first 8 layers, 1% of drafts are accepted (no draft at all);
a trained small model of the same family is the draft to use. What it is good for: a tiny random target
and its first layer (`--tiny`), a pair that agrees, to measure the mechanism on (docs/speculative_decoding.md).

    python examples/make_draft_model.py OUT --layers 8                  # from the default model
    python examples/make_draft_model.py OUT --layers 1 --tiny TARGET    # a tiny random target too (benchmarks)

`--tiny TARGET` first saves a tiny random Llama over the default model's tokenizer into TARGET (4 layers,
hidden 256) and cuts the draft from it: the pair `paged-hf bench --model TARGET` measures the mechanism on.
"""

from __future__ import annotations

import argparse

import torch
import transformers

from paged_hf.loader import default_model


def tiny_target(tokenizer) -> torch.nn.Module:
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512,
                                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=2048, bos_token_id=tokenizer.bos_token_id,
                                      eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def first_layers(model: torch.nn.Module, num_layers: int) -> torch.nn.Module:
    """A copy of `model` that keeps only its first `num_layers` decoder layers."""
    config = model.config.__class__.from_dict(model.config.to_dict())
    if not 1 <= num_layers <= config.num_hidden_layers:
        raise ValueError(f"--layers must be in [1, {config.num_hidden_layers}], got {num_layers}")
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:num_layers]
    draft = model.__class__(config).to(model.dtype).eval()
    missing, _ = draft.load_state_dict(model.state_dict(), strict=False)
    assert not [k for k in missing if "rotary" not in k], missing
    return draft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="folder to save the draft model (and the tokenizer) in")
    parser.add_argument("--layers", type=int, required=True, help="decoder layers to keep")
    parser.add_argument("--model", default=None, help="the model to cut (default: the default model)")
    parser.add_argument("--tiny", metavar="TARGET", help="save a tiny random target here and cut the draft from it")
    args = parser.parse_args()
    if args.tiny:
        _, tokenizer = default_model.load_model(args.model)
        model = tiny_target(tokenizer)
        model.save_pretrained(args.tiny)
        tokenizer.save_pretrained(args.tiny)
        print(f"saved a tiny random target ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters) "
              f"to {args.tiny}")
    else:
        model, tokenizer = default_model.load_model(args.model)
    draft = first_layers(model, args.layers)
    draft.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"saved the first {args.layers} of {model.config.num_hidden_layers} layers to {args.out}")


if __name__ == "__main__":
    main()
