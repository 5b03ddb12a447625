"""Anonymous memory while tensors stream through: glibc's free heap kept under a budget."""

from __future__ import annotations

import ctypes

from mmparity.io.fsio.syscalls import libc


class HeapBudget:
    """Keeps freed heap memory from piling up while tensors stream through.

    Tensor-sized blocks freed back to glibc's heap are reused by later tensors, which is fast; but a
    stream of differently sized tensors fragments the heap, and the free part of it stays resident
    (measured: 800 MB free heap, all anonymous memory, after streaming a 0.9 GB checkpoint). Serving
    every large block from its own mapping instead (a fixed mmap threshold) bounds memory but pays
    fresh page faults on every tensor, which measured 2-3x slower. So: keep the heap, and when its
    free part exceeds `budget` bytes, `malloc_trim` hands the free pages back. No-op without glibc.
    """

    def __init__(self, budget: int = 128 * 2**20):
        self.budget = budget
        self._since_check = 0
        self._release_next = False
        self._libc = None
        lib = libc()
        if lib is None:
            return
        try:
            class MallInfo2(ctypes.Structure):
                _fields_ = [(name, ctypes.c_size_t) for name in (
                    "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                    "fordblks", "keepcost")]

            lib.mallinfo2.restype = MallInfo2
            lib.malloc_trim.argtypes = [ctypes.c_size_t]
            self._libc = lib
        except AttributeError:  # a libc without mallinfo2 (not glibc, or glibc < 2.33)
            pass

    def check(self, nbytes: int) -> None:
        """Called after ``nbytes`` more bytes passed through the heap. mallinfo2 walks the free
        lists, and its cost grows with everything imported before it (a 0.9 GB conversion spent
        37 ms in it when called per tensor): the free part can only have grown by what passed
        through, so it is read once per ``budget / 8`` bytes."""
        if self._libc is None:
            return
        if self._release_next:
            self._release_next = False
            self._since_check = 0
            self._libc.malloc_trim(0)
            return
        self._since_check += nbytes
        if self._since_check < self.budget // 8:
            return
        self._since_check = 0
        if self._libc.mallinfo2().fordblks > self.budget:
            self._libc.malloc_trim(0)

    def begin_stream(self) -> None:
        """The setup is done (source opened, plan made): the next :meth:`check`, after the first
        tensor, hands every free heap page back, whatever the budget. The setup's transients (a
        source's headers, the plan, a writer's layout) leave free heap below the budget, how much
        depending on how they fragmented it (8 to 23 MB between runs of one conversion of 70,310
        tensors), and it would stay resident through the streaming."""
        self._release_next = True


_HEAP = None


def heap_budget() -> HeapBudget:
    global _HEAP
    if _HEAP is None:
        _HEAP = HeapBudget()
    return _HEAP


# glibc's mallopt parameter number (malloc.h).
_M_MMAP_THRESHOLD = -3


def map_large_blocks(threshold: int = 1 << 20) -> bool:
    """Serve every block of ``threshold`` bytes or more from its own mapping, unmapped when freed.

    glibc's default raises its mmap threshold to the largest block freed so far, after which
    tensor-sized blocks come from the heap, and a freed heap block keeps its address space (and,
    fragmented, its pages) until the top of the heap is free. Under an address-space limit
    (``check --low-memory`` with ``RLIMIT_AS``) the weights of the layers already run would pile
    up there; with a fixed threshold the address space in use is what is held. Costs a page fault
    per fresh page (see :class:`HeapBudget`). False without glibc."""
    lib = libc()
    if lib is None or not hasattr(lib, "mallopt"):
        return False
    return bool(lib.mallopt(_M_MMAP_THRESHOLD, int(threshold)))
