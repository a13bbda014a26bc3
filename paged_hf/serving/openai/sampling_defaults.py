"""Sampling defaults from the checkpoint's `generation_config.json`, as vLLM's `--generation-config auto`.

A request field left out (or null) takes the value the model's authors set there (e.g. a chat model's
temperature 0.6, top_p 0.95); only values the file sets apart from transformers' defaults count (vLLM reads
`to_diff_dict()` the same way). What the request sends always wins.
"""

from __future__ import annotations

#: generation_config name -> request field name
_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_config_defaults(model) -> dict:
    """{request field: default} from `model.generation_config` ({} when it has none)."""
    config = getattr(model, "generation_config", None)
    if config is None:
        return {}
    diff = config.to_diff_dict()
    return {field: diff[name] for name, field in _FIELDS.items() if diff.get(name) is not None}
