"""LoRA adapters in three levels, as S-LoRA serves thousands of them from one base model.

1. Registered: a name and its peft folder (`load_adapter`, or any folder under `lora_root`, found by its name
   the first time a request names it).
2. In host memory: the LoRAManager's `adapters`, the least recently used dropped beyond `max_cpu_loras` (read
   again from its folder when a request names it again: same files, same version, same prefix-cache blocks).
3. In a slot: what a step reads (`adapter_slots`: on a GPU `max_loras` copies in device memory, swapped in per
   step by the LoRAManager; on a CPU the host copy itself, read in place).

Reading a folder runs on a background thread and starts as soon as a queued request names an adapter that is
not in host memory (prefetch), so no step waits on disk: the request is queued unbound (`lora` None) and the
scheduler passes over it (`is_ready`) until `poll`, on the engine thread before a step, binds it to the loaded
adapter. A folder that fails to read fails only the requests that wait for it.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterable

from paged_hf.config.groups import LoRAConfig
from paged_hf.core.request import Request
from paged_hf.engine.adapters import lora_manager
from paged_hf.integrations.lora import LoRAManager
from paged_hf.engine.image_prompts import check_adapter
from paged_hf.integrations.peft import AdapterFiles, LoRAAdapter, adapter_folder_under, read_adapter_files
from paged_hf.utils import percentile
from paged_hf.worker.distributed import is_multi_rank
from paged_hf.worker.model_runner import ModelRunner

_STATS_WINDOW = 4096  # load and wait times kept for the percentiles


@dataclass
class AdapterStats:
    num_loads: int = 0  # folders read from disk (explicit loads and prefetches)
    load_seconds: deque = field(default_factory=lambda: deque(maxlen=_STATS_WINDOW))
    wait_seconds: deque = field(default_factory=lambda: deque(maxlen=_STATS_WINDOW))  # queued, adapter loading


def is_ready(request: Request) -> bool:
    """The scheduler's test: a request naming an adapter runs once it is bound to the adapter's weights."""
    return request.adapter is None or request.lora is not None


class AdapterStore:
    def __init__(self, runner: ModelRunner, config: LoRAConfig):
        self.runner = runner
        self.config = config
        self.max_cpu_loras = config.max_cpu_loras
        self.lora_root = config.lora_root
        self.folders: dict[str, str] = {}  # registered adapters: name -> folder
        self._reads: dict[str, Future] = {}  # name -> the read in flight: (AdapterFiles, seconds it took)
        self._wanted: set[str] = set()  # names that queued requests wait for
        self.executor: ThreadPoolExecutor | None = None  # the reads' thread, made on first use
        self.counters = AdapterStats()

    def _manager(self) -> LoRAManager:
        """The runner's LoRAManager, made on first use (peft is imported only for LoRA)."""
        return lora_manager(self.runner, self.config)

    def in_memory(self) -> dict[str, LoRAAdapter]:
        """Level 2, by name (least recently used first)."""
        return {} if self.runner.lora is None else self.runner.lora.adapters

    # --- level 1: registered --------------------------------------------------------------------------
    def register(self, name: str, path) -> LoRAAdapter:
        """Read the folder now (an explicit load: its errors go to the caller) and serve it under `name`."""
        start = time.monotonic()
        adapter = self._manager().load(name, path)
        self._record_load(start)
        self.folders[name] = str(path)
        self._evict_host()
        return adapter

    def unregister(self, name: str) -> None:
        """New requests can no longer name it; requests bound to it finish with its weights."""
        self.folders.pop(name, None)
        self._manager().unload(name)

    def names(self) -> list[str]:
        """Registered and in-memory adapters (a PeftModel's adapters have no folder)."""
        return sorted(set(self.folders) | set(self.in_memory()))

    def folder(self, name: str) -> str | None:
        """The registered folder of `name`, or the folder `lora_root/name` when it holds an adapter."""
        path = self.folders.get(name)
        if path is None and self.lora_root is not None:
            path = adapter_folder_under(self.lora_root, name)
        return path

    # --- levels 2 and 3: host memory, read ahead of the step ------------------------------------------
    def adapter_for(self, name: str) -> LoRAAdapter | None:
        """The in-memory adapter a new request names, or None while its folder is read (the read starts now);
        ValueError for a name that is neither loaded nor registered nor under the root."""
        in_memory = self.in_memory()
        adapter = in_memory.get(name)
        if adapter is not None:
            in_memory[name] = in_memory.pop(name)  # most recently used last
            return adapter
        path = self.folder(name)
        if path is None:
            raise ValueError(f"unknown adapter {name!r}; loaded adapters: {self.names()}")
        self.folders.setdefault(name, path)  # found under the root: registered from now on
        self._wanted.add(name)  # its read starts with the next poll, within the host-memory budget
        return None

    def poll(self, waiting: Iterable[Request]) -> list[tuple[Request, Exception]]:
        """Before a step: add the adapters whose reads finished, bind the queued requests waiting for them,
        start reads for the others in queue order -> (request, error) for each request whose folder failed to
        read. Reads in flight plus the adapters that bound waiting requests hold stay within `max_cpu_loras`, so
        a long queue of distinct adapters is read as its head comes near, not all at once."""
        if not self._wanted:
            return []
        manager = self._manager()
        errors = self._finish_reads(manager)
        failed: list[tuple[Request, Exception]] = []
        self._wanted = set()
        now = time.monotonic()
        held = {r.lora.version for r in waiting if r.lora is not None}  # pinned by bound waiting requests
        budget = None if self.max_cpu_loras is None else self.max_cpu_loras - len(held) - len(self._reads)
        for request in waiting:
            if is_ready(request):
                continue
            adapter = manager.adapters.get(request.adapter)
            if adapter is not None and request.mm_items:  # images meet no adapter of the vision encoder
                try:
                    check_adapter(self.runner.vision, adapter, request.mm_items)
                except ValueError as error:
                    failed.append((request, error))
                    continue
            if adapter is not None:
                for sequence in (request, *request.pending_forks):
                    sequence.lora, sequence.adapter_version = adapter, adapter.version
                self.counters.wait_seconds.append(now - request.arrival_time)
            elif request.adapter in errors:
                failed.append((request, errors[request.adapter]))
            elif (path := self.folders.get(request.adapter)) is None:
                failed.append((request, ValueError(f"adapter {request.adapter!r} was unloaded before it was read")))
            else:
                self._wanted.add(request.adapter)
                if request.adapter not in self._reads and (budget is None or budget > 0):
                    self._start_read(request.adapter, path)
                    budget = None if budget is None else budget - 1
        self._evict_host()
        return failed

    def _start_read(self, name: str, path: str) -> None:
        if name in self._reads:
            return
        if self.executor is None:  # one thread: reads are disk-bound, and they must not compete with steps
            self.executor = ThreadPoolExecutor(1, thread_name_prefix="paged-hf-lora-read")
        self._reads[name] = self.executor.submit(_timed_read, name, path, self._manager().max_rank)

    def _finish_reads(self, manager: LoRAManager) -> dict[str, Exception]:
        """Serve every adapter whose read is done (matched to the model here, on the engine thread)."""
        errors = {}
        for name, future in list(self._reads.items()):
            if not future.done() and not is_multi_rank():  # ranks (tensor, pipeline) bind at the same step
                continue
            del self._reads[name]
            try:
                if name not in self.folders:
                    raise ValueError(f"adapter {name!r} was unloaded before it was read")
                start = time.monotonic()
                files, read_seconds = future.result()
                manager.add(files)
                manager.adapters[name] = manager.adapters.pop(name)  # most recently used last
                self._record_load(start, read_seconds)
            except Exception as exc:  # noqa: BLE001 - the folder's fault: only its requests fail
                errors[name] = exc
        return errors

    def _evict_host(self) -> None:
        """Keep at most `max_cpu_loras` adapters in host memory, least recently used out first; only those with
        a folder to read them back from (a PeftModel's adapters stay). Requests bound to one keep its weights."""
        if self.max_cpu_loras is None:
            return
        in_memory = self._manager().adapters
        evictable = [name for name in in_memory if name in self.folders and name not in self._wanted]
        for name in evictable[: max(0, len(in_memory) - self.max_cpu_loras)]:
            del in_memory[name]

    def stats(self, running: Iterable[Request], waiting: Iterable[Request]) -> dict:
        """The three levels' counts, loads and waits, and vLLM's lora_requests_info ({} without any adapter)."""
        manager = self.runner.lora
        if manager is None:
            return {}
        return {
            "lora_registered": len(self.folders.keys() | manager.adapters.keys()),
            "lora_in_memory": len(manager.adapters),
            "lora_in_slots": len(manager.resident),
            "lora_loads": self.counters.num_loads,
            "lora_load_seconds_p50": percentile(self.counters.load_seconds, 50) or 0.0,
            "lora_load_seconds_p99": percentile(self.counters.load_seconds, 99) or 0.0,
            "lora_wait_seconds_p99": percentile(self.counters.wait_seconds, 99) or 0.0,
            "lora_running_adapters": sorted({r.adapter for r in running if r.adapter is not None}),
            "lora_waiting_adapters": sorted({r.adapter for r in waiting if r.adapter is not None}),
            "max_loras": manager.num_slots,
        }

    def _record_load(self, start: float, read_seconds: float = 0.0) -> None:
        """A load's time: the disk read (on the reader thread) and the matching to the model (on this one)."""
        self.counters.num_loads += 1
        self.counters.load_seconds.append(read_seconds + time.monotonic() - start)

    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)



def _timed_read(name: str, path: str, max_rank: int) -> tuple[AdapterFiles, float]:
    start = time.monotonic()
    return read_adapter_files(name, path, max_rank), time.monotonic() - start

