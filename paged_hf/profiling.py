"""Named ranges for `paged-hf bench --profile` (paged_hf.bench.step_profile): a step's phases and its attention
calls show up in torch.profiler's trace under `paged_hf::<name>`. Off, a range is a no-op context (the engine
pays one global read and a nullcontext per range); `enabled()` turns them on for the profile's steps."""

from __future__ import annotations

import contextlib

import torch

_ACTIVE = False
_OFF = contextlib.nullcontext()


def active() -> bool:
    """Whether the ranges are on (a profiled step: the compiled decode layer, which the profiler cannot see into,
    leaves its layers to the lean path's calls, worker/fast_paths/native_layer.py)."""
    return _ACTIVE


def span(name: str):
    """`with span("schedule"):` -> a torch.profiler range `paged_hf::schedule` while profiling, else nothing."""
    return torch.profiler.record_function(f"paged_hf::{name}") if _ACTIVE else _OFF


@contextlib.contextmanager
def enabled():
    global _ACTIVE
    _ACTIVE = True
    try:
        yield
    finally:
        _ACTIVE = False
