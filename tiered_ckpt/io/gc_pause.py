"""A pause of CPython's cyclic garbage collector while code builds many objects without cycles.

Why: a step's manifest at thousands of ranks, and a state of tens of thousands of arrays,
are built from as many small containers (decoded payloads, records, a state's nodes and
header entries) that all stay alive until the build returns. Each full pass of the
collector walks every live container, and the more survivors pile up during one build,
the more passes it runs, so with the collector running the build costs O(N log N) in the
number of ranks or arrays rather than O(N). Reference counting still frees what these
phases drop; only garbage in cycles, made meanwhile by any thread, waits until the pause
ends. Every pause covers CPU work only, never a wait on a collective or on storage (a
state's flattening may copy a device's tensors to the host), so it lasts as long as the
work itself.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["cyclic_gc_paused"]

_lock = threading.Lock()
_depth = 0  # pauses open now, in every thread
_resume = False  # whether the collector was enabled when the outermost open pause began


@contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """Run the block with the cyclic collector disabled (process-wide).

    Pauses nest and may overlap between threads: when the last open one ends, the collector
    is enabled again if, and only if, it was enabled when the first of them began (so a
    caller that disables it while a pause is open finds it enabled again then).
    """
    global _depth, _resume
    with _lock:
        if _depth == 0:
            _resume = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _resume:
                gc.enable()
