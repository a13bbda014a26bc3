"""Long pure-Python work in a worker thread, paced so that the engine thread keeps its speed.

A thread running Python holds the GIL for the whole switch interval (5 ms), and the engine thread gives the
GIL up and waits for it again around every torch op: one second of work in a worker thread stalled a running
stream by seconds (measured: 4.3 s while 2,048 embeddings were encoded). So such work calls `Pacer.tick()`
between its small pieces: at full speed for its first FULL_SPEED_S (short work never waits), then in slices
of SLICE_S, each followed by a PAUSE_S sleep that leaves the GIL to the others.
"""

from __future__ import annotations

import time
from collections.abc import Callable

FULL_SPEED_S, SLICE_S, PAUSE_S = 0.05, 0.001, 0.004


class Pacer:
    """`busy()`: whether anything else is running (e.g. the engine has requests in flight); while it says no,
    the work runs at full speed (the pauses would only slow it)."""

    def __init__(self, busy: Callable[[], bool] | None = None, full_speed_s: float = FULL_SPEED_S):
        self.busy = busy
        self.next_pause = time.monotonic() + full_speed_s

    def tick(self) -> None:
        """Between two pieces of work: sleep (GIL released) when this slice is used up."""
        if time.monotonic() > self.next_pause and (self.busy is None or self.busy()):
            time.sleep(PAUSE_S)
            self.next_pause = time.monotonic() + SLICE_S
