"""Giving freed memory back to the system after a large piece of work in a worker thread.

glibc's malloc gives each thread its own arena and keeps what is freed there for reuse: tokenizing a 3.9 MB
prompt in a worker thread left the server 320 MB larger after the request ended (measured; `malloc_trim(0)`
brought it back to +20 MB). So work over `LARGE_CHARS` trims the arenas when it is done (a few ms). Elsewhere
than glibc this does nothing.
"""

from __future__ import annotations

import gc

from paged_hf.utils import trim_heap

#: Inputs at least this long (characters) are followed by a trim.
LARGE_CHARS = 1 << 20
#: Requests whose body or answer is at least this large are followed by a trim, whatever their answer: parsing a
#: 3 MB body of 1M token ids, or one with a 1 MB string, left ~80 MB with the server (measured) until the next
#: trim, and 2,048 embeddings of the default model (a 23 MB answer, the engine's largest steps yet) 144 MB.
LARGE_BODY_BYTES = 256 << 10


def trim_if_large(num_chars: int) -> None:
    """Give the freed heap back to the system after work on `num_chars` characters, if that was large."""
    if num_chars >= LARGE_CHARS:
        trim_heap()


def freeze_startup_objects() -> None:
    """Move everything made before serving (the model, the tokenizer, the engine) out of the garbage collector's
    reach, as vLLM's server does: a full collection walks every tracked object, and with ~1M of them it paused
    every stream for 0.3-0.5 s (measured) when a large request's allocations set one off."""
    gc.collect()
    gc.freeze()
