"""How a model folder says its embeddings are pooled: sentence-transformers' `modules.json` and the
`Pooling` module's `config.json` (both the current `"pooling_mode": "mean"` form and the older
`pooling_mode_mean_tokens: true` flags), and whether a `Normalize` module follows.

A module that changes the vector beyond pooling and normalizing (a `Dense` projection, ...) is a ValueError:
embeddings that silently skip it would be wrong (vLLM mis-pooled decoder models this way).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

POOLING_TYPES = ("mean", "cls", "lasttoken", "max")
_LEGACY_FLAGS = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
                 "pooling_mode_lasttoken": "lasttoken", "pooling_mode_max_tokens": "max",
                 "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                 "pooling_mode_weightedmean_tokens": "weightedmean"}


@dataclass(frozen=True)
class PoolingConfig:
    """`pooling_type`: one of POOLING_TYPES; `normalize`: L2-normalize the pooled vector; `source`: where it
    was read (a file, or "default")."""

    pooling_type: str = "lasttoken"
    normalize: bool = True
    source: str = "default"


#: a decoder model without a sentence-transformers config: its last token has seen the whole text
DEFAULT_DECODER_POOLING = PoolingConfig("lasttoken", True, "default (last token, normalized)")


def read_pooling_config(folder) -> PoolingConfig | None:
    """The folder's sentence-transformers pooling, or None when it has no `modules.json` (or is no folder)."""
    folder = Path(folder)
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    pooling_type, normalize = None, False
    for module in sorted(modules, key=lambda m: m.get("idx", 0)):
        kind = module.get("type", "").rsplit(".", 1)[-1]
        if kind == "Pooling":
            pooling_type = _pooling_type(folder / module.get("path", "") / "config.json")
        elif kind == "Normalize":
            normalize = True
        elif kind == "Transformer":
            _check_plain_text(folder / module.get("path", "") / "sentence_bert_config.json")
        else:
            raise ValueError(f"{modules_file}: the sentence-transformers module {module.get('type')!r} is not "
                             f"supported for embeddings (only Transformer, Pooling and Normalize)")
    if pooling_type is None:
        raise ValueError(f"{modules_file} has no Pooling module")
    return PoolingConfig(pooling_type, normalize, str(modules_file))


def _check_plain_text(config_file: Path) -> None:
    """sentence-transformers >= 6 may render texts through the chat template first (a "message" modality):
    embeddings of the plain text would differ from its own, so such a folder is refused."""
    if not config_file.is_file():
        return
    modalities = json.loads(config_file.read_text()).get("modality_config") or {}
    if "message" in modalities:
        raise ValueError(f"{config_file}: the Transformer module renders texts through the chat template "
                         f"(modality 'message'), which paged_hf does not do for embeddings; remove 'message' "
                         f"from modality_config to embed the plain text")


def _pooling_type(config_file: Path) -> str:
    config = json.loads(config_file.read_text())
    if "pooling_mode" in config:
        modes = config["pooling_mode"]
        modes = [modes] if isinstance(modes, str) else list(modes)
    else:
        modes = [mode for flag, mode in _LEGACY_FLAGS.items() if config.get(flag)]
    if len(modes) != 1 or modes[0] not in POOLING_TYPES:
        raise ValueError(f"{config_file}: pooling {modes} is not supported; one of {list(POOLING_TYPES)} is")
    if config.get("include_prompt", True) is False:
        raise ValueError(f"{config_file}: include_prompt=false (a prompt excluded from pooling) is not supported")
    return modes[0]
