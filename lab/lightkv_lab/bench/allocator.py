"""How the benchmark process allocates host memory: glibc's default, or a steady heap.

On a GPU, PyTorch's caching allocator hands a freed block to the next tensor of its size,
so a prefill's activations cost no fresh memory after the first. On a CPU, torch asks
glibc, which serves every allocation above its mmap threshold (at most 32 MB) with fresh
pages and returns them when freed: at 7B width the activations of a 3,000-token prefill
are above it, those of a 1,500-token one partly below, so a longer sequence pays page
faults a shorter one does not, and every ratio of a long prefill to a short one moves
(measured: uncompressed 11% faster with a steady heap, LightKV at 55% kept 5% faster;
`benchmarks/results/low-budget/allocator/`). A steady heap (`mallopt`: no mmap for large
blocks, no trimming) makes the CPU allocate like the GPU does. It changes how memory is
obtained, never what is computed.

The price: the heap keeps what it frees, fragmented by every variant's allocations, so a
process holds more than it uses (a 16-layer full-width run of six variants grew to 24 GB
and was killed on a 24 GB machine; the same run with fewer variants fitted). Deep runs on
small machines take ``system``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["ALLOCATORS", "host_allocator"]

ALLOCATORS = ("steady", "system")
"""``steady``: freed memory stays in the heap for reuse (glibc only); ``system``: the C
library's defaults."""

# glibc's mallopt parameters (malloc.h) and the defaults mallopt(3) documents
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4
_STEADY = {_M_MMAP_MAX: 0, _M_TRIM_THRESHOLD: 2**31 - 1, _M_TOP_PAD: 2**30}
_DEFAULTS = {_M_MMAP_MAX: 65536, _M_TRIM_THRESHOLD: 128 * 1024, _M_TOP_PAD: 128 * 1024}


def _mallopt():
    """glibc's ``mallopt``, or a string saying why there is none."""
    if not sys.platform.startswith("linux"):
        return f"a steady heap needs glibc's mallopt; this is {sys.platform}"
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError) as err:
        return f"no mallopt in the C library: {err}"
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return fn


@contextmanager
def host_allocator(name: str) -> Iterator[str]:
    """Use allocator ``name`` for this process's host memory inside the block.

    Yields what the process uses: ``"steady"``, ``"system"``, or ``"system (<why not
    steady>)"`` where no steady heap is available (not Linux/glibc). On leaving a steady
    block the documented glibc defaults are set back (after which glibc no longer adapts
    its mmap threshold, as after any ``mallopt``); memory the heap kept may stay resident
    until glibc next trims it.

    Raises:
        ValueError: ``name`` is not one of `ALLOCATORS`.
    """
    if name not in ALLOCATORS:
        raise ValueError(f"unknown allocator {name!r}; choose from {list(ALLOCATORS)}")
    mallopt = _mallopt() if name == "steady" else None
    if mallopt is None:
        yield "system"
        return
    if isinstance(mallopt, str):
        yield f"system ({mallopt})"
        return
    if not all(mallopt(param, value) == 1 for param, value in _STEADY.items()):
        for param, value in _DEFAULTS.items():
            mallopt(param, value)
        yield "system (mallopt refused the settings)"
        return
    try:
        yield "steady"
    finally:
        for param, value in _DEFAULTS.items():
            mallopt(param, value)
