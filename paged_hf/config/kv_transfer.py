"""`KVTransferConfig`: vLLM's `kv_transfer_config`, for disaggregated prefill and decode (docs/disaggregated.md).

Given as `PagedConfig.kv_transfer_config` (a dict, JSON text or a KVTransferConfig) or `--kv-transfer-config
'{JSON}'`, with vLLM's field names. One connector, `PagedHFConnector`: the KV tier's block files are what
travels. A producer writes every full prompt block through to its directory and answers with
`kv_transfer_params`; a consumer given those params brings the blocks into its own directory (nothing to do when
both share it; else a pull over HTTP from the producer) before the request is scheduled, so its prefix lookup
finds them as it finds any tier block: checked, or recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from paged_hf.utils import config_fields

CONNECTOR = "PagedHFConnector"
ROLES = ("kv_producer", "kv_consumer", "kv_both")
#: kv_connector_extra_config's keys: the URL consumers pull from (default: the one the request came in on), the
#: API key a consumer pulls with (default: the key of the request that carries the params), the pull's timeout
EXTRA_KEYS = ("url", "api_key", "timeout_s")


@dataclass
class KVTransferConfig:
    kv_connector: str = CONNECTOR
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kv_connector != CONNECTOR:
            raise ValueError(f"kv_transfer_config: kv_connector must be {CONNECTOR!r} (the KV tier's block files; "
                             f"vLLM's NIXL/LMCache connectors need GPUs), got {self.kv_connector!r}")
        if self.kv_role not in ROLES:
            raise ValueError(f"kv_transfer_config: kv_role must be one of {', '.join(ROLES)}, got {self.kv_role!r}")
        extra = self.kv_connector_extra_config
        if not isinstance(extra, dict) or set(extra) - set(EXTRA_KEYS):
            raise ValueError(f"kv_transfer_config: kv_connector_extra_config takes {', '.join(EXTRA_KEYS)}, got "
                             f"{extra!r}")
        timeout = extra.get("timeout_s", 60)
        if isinstance(timeout, bool) or not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"kv_transfer_config: timeout_s must be seconds > 0, got {timeout!r}")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def timeout_s(self) -> float:
        return float(self.kv_connector_extra_config.get("timeout_s", 60))

    @classmethod
    def parse(cls, value) -> KVTransferConfig | None:
        """None, a KVTransferConfig, a dict or JSON text of its fields (vLLM's names; others are an error)."""
        if value is None or isinstance(value, cls):
            return value
        return cls(**config_fields(value, "kv_transfer_config", {f.name for f in fields(cls)}))
