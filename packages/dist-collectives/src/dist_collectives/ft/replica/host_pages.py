"""Faulting in fresh host memory before a transport writes into it (Linux only).

A tensor fresh from ``torch.empty`` has no pages yet: the kernel maps each 4 KiB page
the first time it is written. When that first write is a socket receive, every page
fault happens inside the receive and the transfer slows down many times over. Asking
for transparent huge pages (``MADV_HUGEPAGE``, as torch's ``THP_MEM_ALLOC_ENABLE`` does
for its own allocations) and mapping them in one call (``MADV_POPULATE_WRITE``, Linux
5.14) before the receive is posted makes that cost small and moves it out of the
receive. Elsewhere, or when the kernel refuses, :func:`populate` does nothing and the
pages fault in as before: it only changes how fast, never what arrives.
"""

from __future__ import annotations

import ctypes
import logging
import sys

import torch

logger = logging.getLogger(__name__)

_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23
_HUGE_PAGE = 2 << 20
_PAGE = 4096
# Below this a tensor has few pages, and it may come from the heap, already mapped.
MIN_BYTES = 2 << 20

_libc: ctypes.CDLL | None = None
_enabled = sys.platform.startswith("linux")


def _madvise(start: int, stop: int, alignment: int, advice: int) -> bool:
    assert _libc is not None
    first = (start + alignment - 1) // alignment * alignment
    last = stop // alignment * alignment
    if last <= first:
        return True
    result = _libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), advice)
    return int(result) == 0


def _ready() -> bool:
    global _libc, _enabled
    if _enabled and _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        except (OSError, AttributeError):
            _enabled = False
    return _enabled


def _span(tensor: torch.Tensor) -> tuple[int, int] | None:
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.device.type != "cpu" or nbytes < MIN_BYTES or not _ready():
        return None
    return tensor.data_ptr(), tensor.data_ptr() + nbytes


def prefer_huge_pages(tensor: torch.Tensor) -> None:
    """Asks for transparent huge pages under a contiguous CPU ``tensor`` not yet written.

    Only a hint: the system may have huge pages off, and then nothing changes. Call it
    once for the whole tensor, before :func:`populate` maps parts of it.
    """
    span = _span(tensor)
    if span is not None:
        _madvise(*span, _HUGE_PAGE, _MADV_HUGEPAGE)


def populate(tensor: torch.Tensor) -> bool:
    """Maps the pages of a contiguous CPU ``tensor`` (or slice) before they are written.

    Returns whether the kernel mapped them; False (and nothing done) for a GPU tensor,
    a small one, or where the system does not offer it.
    """
    global _enabled
    span = _span(tensor)
    if span is None:
        return False
    if not _madvise(*span, _PAGE, _MADV_POPULATE_WRITE):
        _enabled = False  # an older kernel: it will not work next time either
        logger.debug("madvise(MADV_POPULATE_WRITE) refused; pages fault in on first write")
        return False
    return True
