"""The families the engine has code of its own for, and the one place the model probe and the model runner ask.

A family (or a mechanism several families share) is one module of this folder with one `Family` (base.py): the
modules it serves with stand-ins in a step, the recurrent blocks that keep their states outside the cache, the
cache classes their forwards insist on, what it refuses and why, what it overrides on the model for a step.
Modules are recognised by their code (worker/code_match.py): a module whose class defines the forward of a
transformers reference class (under any decorator) is served, so copies of a family's code in other model files
are served alike, and a module whose code changed is not. Every other module runs its own forward through the
paged attention function, or the model is refused by the probes naming why.

Adding a family: a module here with its `Family`, and one line in `FAMILIES` (docs/architecture.md walks through
one). A term its layers add to their scores is a field of kernels/spec.py `ScoreTerms`, computed by the kernels
that serve it; a stand-in says which terms it hands on (`score_terms`).
"""

from __future__ import annotations

import torch

from paged_hf.worker.families import alibi, falcon, git, gpt_neo, indexed, inkling, own_states, xglm
from paged_hf.worker.families.base import Family
from paged_hf.worker.families.own_states import OwnStates
from paged_hf.worker.hybrid.recurrent_state import StateLayer
from paged_hf.worker.stand_ins import ModuleSwaps

#: every family, in the order their rules are asked (a module is served by the first that recognises it)
FAMILIES: tuple[Family, ...] = (gpt_neo.FAMILY, falcon.FAMILY, xglm.FAMILY, git.FAMILY, alibi.FAMILY,
                                inkling.FAMILY, indexed.FAMILY, own_states.FAMILY)


def refusal(model: torch.nn.Module, config) -> str | None:
    """Why a family says this model cannot be served exactly; None where none objects."""
    for family in FAMILIES:
        reason = family.refusal(model, config) if family.refusal is not None else None
        if reason:
            return reason
    return None


def cache_class_for(cls: type) -> type | None:
    """The class that answers a forward which insists on the cache class `cls` (xLSTM's), or None."""
    return next((rule.make for family in FAMILIES for rule in family.cache_classes
                 if rule.reference_class() is cls), None)


def own_state_blocks(model: torch.nn.Module) -> dict[int, OwnStates]:
    """Layer index -> the states' keeper of each block of `model` that keeps its states outside the cache; a
    block's layer index is its `layer_id`, else its decoder layer's."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", getattr(decoder, "blocks", None))
    decoder_layer = {id(m): i for i, layer in enumerate(layers if isinstance(layers, torch.nn.ModuleList) else ())
                     for m in layer.modules()}
    blocks = {}
    for module in model.modules():
        keeper = next((rule.make for family in FAMILIES for rule in family.state_keepers if rule.recognises(module)),
                      None)
        layer_idx = getattr(module, "layer_id", decoder_layer.get(id(module)))
        if keeper is not None and layer_idx is not None:
            blocks[layer_idx] = keeper(module, layer_idx)
    return blocks


def read_own_state_layers(model: torch.nn.Module) -> list[StateLayer]:
    """The state layers of the blocks that keep their states outside the cache (after one forward)."""
    layers = [keeper.state_layer() for keeper in own_state_blocks(model).values()]
    return [layer for layer in layers if layer is not None]


class FamilyStandIns(ModuleSwaps):
    """Every module of the model that a family serves with a stand-in, swapped for it in a step, and the
    families' overrides on the model for the step. `families`: the names of the families that serve it."""

    def __init__(self, model: torch.nn.Module, config):
        self.sites, self.families = [], []
        for parent in model.modules():
            for name, child in parent._modules.items():
                found = _stand_in(child, config, model) if child is not None else None
                if found is not None:
                    family, stand_in = found
                    self.sites.append((parent, name, child, stand_in))
                    self.families += [] if family.name in self.families else [family.name]
        self.overrides = [override for family in FAMILIES if family.name in self.families
                          and family.step_overrides is not None for override in family.step_overrides(model)]

    def score_terms(self) -> dict[int, frozenset[str]]:
        """cache layer -> the ScoreTerms its stand-in hands the kernel (ALiBi's slopes: the module's own code
        computes them inline, so no attention call of its shows them to the model probe)."""
        return {original.layer_idx: stand_in.score_terms for _, _, original, stand_in in self.sites
                if stand_in.score_terms and getattr(original, "layer_idx", None) is not None}

    def selects_keys(self) -> bool:
        """Some stand-in applies an indexer's selection of keys (sparse attention)."""
        return any("key_mask" in stand_in.score_terms for *_, stand_in in self.sites)

    def __enter__(self) -> None:
        super().__enter__()
        for owner, name, value in self.overrides:
            setattr(owner, name, value)  # an instance attribute over the class's method, for the step

    def __exit__(self, *exc) -> None:
        for owner, name, _ in self.overrides:
            owner.__dict__.pop(name, None)
        super().__exit__(*exc)


def _stand_in(module: torch.nn.Module, config, model: torch.nn.Module) -> tuple[Family, torch.nn.Module] | None:
    """(the family, its stand-in) for a module a family serves, else None."""
    for family in FAMILIES:
        for rule in family.stand_ins:
            if rule.recognises(module):
                stand_in = rule.make(module, config, model)
                if stand_in is not None:
                    return family, stand_in
    return None
