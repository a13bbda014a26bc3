"""The worker threads that prepare requests, at a lower CPU priority than the engine's threads.

Off the event loop and without the GIL is not enough on a machine with few cores: tokenizing a 1 MB prompt takes
a core for 1.2 s, and with that core gone the engine's torch threads ran every step of a running stream 5x as long
(measured, 2 cores, the default model: 50 ms -> 250-320 ms between tokens for the whole 1.5 s, the GIL free all
along). At nice +10 (Linux threads have their own) such a thread gets ~10% of a core the engine wants and all of
an idle one, so streams keep their pace and preparation waits only while the engine is busy.
"""

from __future__ import annotations

import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

PREP_NICENESS = 10


def lower_priority() -> None:
    """This thread only (on Linux a thread is its own scheduling entity); elsewhere nothing."""
    if not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + PREP_NICENESS))
    except OSError:
        pass


def install_prep_executor(loop) -> ThreadPoolExecutor:
    """`loop`'s default executor (asyncio.to_thread's) becomes a pool of low-priority threads."""
    executor = ThreadPoolExecutor(thread_name_prefix="paged_hf-prep", initializer=lower_priority)
    loop.set_default_executor(executor)
    return executor
