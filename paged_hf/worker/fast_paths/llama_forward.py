"""The forward of a model whose top runs LlamaForCausalLM's code and whose decoder runs LlamaModel's, for a paged
step on the CPU fast paths: the same module calls in the same order as those forwards make, without what
transformers wraps around them, and without the later layers of a stack computed in one call at its first.

Why: at one row a step's weights are read in ~10 ms on the default model, and what runs around them in Python
counts. transformers' wrappers of the two forwards (keyword deprecations, config defaults, output capture, the
output dataclasses) and the 29 later layers handing the compiled stack's output on (`LeanDecodes.pass_on`) were
~0.6 ms of a batch-1 bf16 token. The runner takes this path only where those wrappers can change nothing it reads:
no hooks on the two modules or global ones, forwards as their classes define them, the step's own keywords; the
submodules (embedding, rotary, layers, norm, head) are called as modules, so the step's stand-ins, adapters'
wrappers and hooks on them run as in the model's forward; where the stack runs as one compiled call, that call
also computes the final norm and the head on the kept rows (stack_tail.py: where the norm is the step's fused one
and the head a linear of the few-row loops). A step's logits are those of `model(**kwargs)` bit for bit
(tests/worker/fast_paths/test_llama_forward.py, which also runs on the newest transformers: a release that changes
either forward's code makes `of` answer None, one that changes what they mean fails that test).
"""

from __future__ import annotations

import torch
from torch.nn.modules import module as torch_module
from transformers import modeling_utils
from transformers.models.llama.modeling_llama import LlamaForCausalLM, LlamaModel

from paged_hf.worker.code_match import forward_globals, runs_forward_of, runs_own_class_code
from paged_hf.worker.fast_paths.lean_layers import LeanDecodes
from paged_hf.worker.fast_paths.stack_tail import StackTail

#: the keywords of a step's forward that this path computes (the runner's; anything else: the model's own forward)
STEP_KEYWORDS = frozenset({"input_ids", "attention_mask", "position_ids", "cache", "use_cache", "logits_to_keep"})
_SLICE_LOGITS_TO_KEEP = getattr(modeling_utils, "slice_logits_to_keep", None)  # LlamaForCausalLM.forward's


class LlamaForward:
    """LlamaForCausalLM's forward over LlamaModel's for the runner's steps, called without transformers' wrappers."""

    def __init__(self, model: torch.nn.Module, decoder: torch.nn.Module, lean: LeanDecodes):
        self.model, self.decoder, self.lean = model, decoder, lean
        self.forwards = type(model).forward, type(decoder).forward  # as they were when recognised
        # their modeling files' globals, read at each call as the forwards read them (a patch of one is followed)
        self.decoder_globals, self.model_globals = forward_globals(decoder), forward_globals(model)
        self.enabled = True  # (tests turn it off to compare with the model's own forward)
        self.tail = StackTail()  # the final norm and the head, asked of the stack's compiled call
        self.steps_served = 0  # a count, for tests

    @classmethod
    def of(cls, model: torch.nn.Module, lean: LeanDecodes) -> LlamaForward | None:
        """For a model whose forward is LlamaForCausalLM's over a decoder (`model.model`) whose forward is
        LlamaModel's, each reading those names from its modeling file; else None."""
        decoder = model._modules.get("model")
        if not (runs_forward_of(model, LlamaForCausalLM) and runs_forward_of(decoder, LlamaModel)):
            return None
        if "create_causal_mask" not in forward_globals(decoder) or "slice_logits_to_keep" not in forward_globals(model):
            return None
        return cls(model, decoder, lean)

    def serves(self, kwargs: dict) -> bool:
        """The two forwards would run as recognised (their modules in place, no hooks of their own or global ones,
        no forward patched on them or their classes) on the step's own keywords."""
        model, decoder = self.model, self.decoder
        return (self.enabled and kwargs.keys() <= STEP_KEYWORDS and "input_ids" in kwargs
                and not torch_module._global_forward_hooks and not torch_module._global_forward_pre_hooks
                and model._modules.get("model") is decoder
                and (type(model).forward, type(decoder).forward) == self.forwards
                and runs_own_class_code(model) and runs_own_class_code(decoder))

    def __call__(self, input_ids: torch.Tensor, attention_mask, position_ids: torch.Tensor, cache, use_cache: bool,
                 logits_to_keep: int | torch.Tensor = 0) -> torch.Tensor:
        """The logits [1, kept, vocab_size]: LlamaModel.forward's calls given the embeddings' input, positions and
        a cache, then LlamaForCausalLM.forward's head on the kept rows."""
        decoder = self.decoder
        inputs_embeds = decoder.embed_tokens(input_ids)
        causal_mask = self.decoder_globals["create_causal_mask"](
            config=decoder.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask, cache=cache,
            position_ids=position_ids)
        hidden_states = inputs_embeds
        position_embeddings = decoder.rotary_emb(hidden_states, position_ids=position_ids)
        layers = list(decoder.layers)[: decoder.config.num_hidden_layers]  # (the layers a ModuleList's slice holds)
        slicing, tail = self.model_globals["slice_logits_to_keep"], self.tail
        if slicing is _SLICE_LOGITS_TO_KEEP:  # (what the tail computes; a patched function is called instead)
            tail.ask(decoder.norm, self.model.lm_head, logits_to_keep)
        self.lean.tail, handed_on = tail, False
        try:
            for index, decoder_layer in enumerate(layers):
                hidden_states = decoder_layer(hidden_states, attention_mask=causal_mask,
                                              position_embeddings=position_embeddings, position_ids=position_ids,
                                              cache=cache, use_cache=use_cache)
                if index == 0 and self.lean.take_handed_on(layers, hidden_states):
                    handed_on = True  # the whole stack ran at the first layer; the others would hand its output on
                    break
        finally:
            self.lean.tail = None
        self.steps_served += 1
        logits = tail.take()  # the norm's and the head's, where the stack's call computed them
        if handed_on and logits is not None:
            return logits
        hidden_states = decoder.norm(hidden_states)
        return self.model.lm_head(slicing(hidden_states, logits_to_keep))
