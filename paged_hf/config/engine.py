"""Engine configuration: `PagedConfig`, one group of fields per part of the engine (config/groups.py: the cache, the
scheduler, LoRA, request limits, the CPU fast paths) beside the nested speculative and KV-transfer configs and the
quantization applied at load. Every field has a default; `paged_hf.wrap(model, **fields)` fills it by flat names,
and `config.block_size` reads a field wherever its group keeps it. A part gets its group (`config.scheduler`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from paged_hf.config.groups import CacheConfig, CpuPaths, LoRAConfig, RequestLimits, SchedulerConfig
from paged_hf.config.kv_transfer import KVTransferConfig
from paged_hf.config.options import Flag, one_of, option
from paged_hf.config.speculative import SpeculativeConfig

#: what `quantization` accepts (paged_hf/loader/quantized.py): W8A8, 4-bit weights by round to nearest or GPTQ,
#: and those 4-bit weights with int8 activations (W4A8)
QUANTIZATION_NAMES = ("int8", "w4a16", "w4a16_gptq", "w4a8")
#: group name -> its dataclass, in the order the docs and the flags list them
GROUPS = {"cache": CacheConfig, "scheduler": SchedulerConfig, "lora": LoRAConfig, "limits": RequestLimits,
          "cpu": CpuPaths}


@dataclass(frozen=True)
class _Nested:
    """The fields of PagedConfig itself, declared as the groups' are (for the flags and the docs)."""
    speculative: object = option(
        None, "speculative decoding, vLLM's speculative_config: a SpeculativeConfig or its fields as a dict / JSON "
        'text, e.g. {"method": "ngram", "num_speculative_tokens": 4}; None: off',
        flags=(Flag(("--speculative-config",), metavar="JSON",
                    parse=lambda text: dataclasses.asdict(SpeculativeConfig.parse(text))),))
    kv_transfer_config: object = option(
        None, "disaggregated prefill/decode, vLLM's kv_transfer_config: a KVTransferConfig or its fields as a dict / "
        'JSON text, e.g. {"kv_connector": "PagedHFConnector", "kv_role": "kv_producer"} (docs/disaggregated.md)',
        flags=(Flag(("--kv-transfer-config",), metavar="JSON",
                    parse=lambda text: dataclasses.asdict(KVTransferConfig.parse(text))),))
    quantization: str | None = option(
        None, "quantize the model's linears at load (int8: W8A8 per channel; w4a16: 4-bit groups of 64, round to "
        "nearest; w4a16_gptq: the same by GPTQ on text the model writes, minutes to load; w4a8: w4a16's weights "
        "repacked, activations int8 per block of 32, as llama.cpp's Q4_0); a quantized checkpoint "
        "folder is served quantized without it", one_of(None, *QUANTIZATION_NAMES),
        (Flag(("--quantization",), choices=QUANTIZATION_NAMES),))


#: every declared field: (the group it lives in, or None for PagedConfig's own, its dataclasses.Field)
DECLARED = {field.name: (group, field) for group, cls in GROUPS.items() for field in dataclasses.fields(cls)}
DECLARED.update({field.name: (None, field) for field in dataclasses.fields(_Nested)})


@dataclass(init=False)
class PagedConfig:
    cache: CacheConfig
    scheduler: SchedulerConfig
    lora: LoRAConfig
    limits: RequestLimits
    cpu: CpuPaths
    speculative: SpeculativeConfig | None
    kv_transfer_config: KVTransferConfig | None
    quantization: str | None

    def __init__(self, **fields):
        """Flat field names (`block_size=4`), or a whole group (`cache=CacheConfig(...)`) with flat names over it;
        ValueError naming an unknown field or a value out of its bounds."""
        unknown = sorted(set(fields) - set(DECLARED) - set(GROUPS))
        if unknown:
            raise ValueError(f"unknown PagedConfig field(s) {unknown}; known: {sorted(DECLARED)}")
        for group, cls in GROUPS.items():
            own = {name: fields[name] for name, (where, _) in DECLARED.items() if where == group and name in fields}
            given = fields.get(group)
            self.__dict__[group] = dataclasses.replace(given, **own) if given is not None else cls(**own)
        self.speculative = SpeculativeConfig.parse(fields.get("speculative"))
        self.kv_transfer_config = KVTransferConfig.parse(fields.get("kv_transfer_config"))
        quantization = DECLARED["quantization"][1].metadata["check"]
        self.quantization = quantization("quantization", fields.get("quantization"))

    def __getattr__(self, name: str):
        """A group's field by its flat name (`config.block_size`)."""
        where = DECLARED.get(name, (None, None))[0]
        if where is None or where not in self.__dict__:
            raise AttributeError(f"PagedConfig has no field {name!r}")
        return getattr(self.__dict__[where], name)

    def flat(self) -> dict:
        """Every field by its flat name."""
        return {name: getattr(self, name) for name in DECLARED}

    def replace(self, **fields) -> PagedConfig:
        """A copy with `fields` (flat names) changed, checked again."""
        return PagedConfig(**{**self.flat(), **fields})

    @classmethod
    def from_kwargs(cls, **kwargs) -> PagedConfig:
        return cls(**kwargs)
