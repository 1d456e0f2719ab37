"""Drop this process's mapped pages of checkpoint files it has read and will not read again (Linux).

transformers 5 maps every safetensors file of a checkpoint (safe_open, mmap backend) for the whole of
from_pretrained, and the tensors it reads are views of those mappings: every page read stays in the process's RSS
until loading ends, however early its bytes were consumed. They are page cache (one copy shared by every process
that maps the file, reclaimable), but they count in each process's RSS, and a process that reads a 31 GB checkpoint
holds 31 GB more RSS at the end of loading than it keeps. madvise(MADV_DONTNEED) unmaps them from this process;
the page cache keeps them, and a page read again is mapped again from it (or read from the file), with the same
bytes.

Only mappings that are lossless to drop are dropped: those of the named files whose pages were never written by this
process (no private copy-on-write page: /proc/self/smaps `Anonymous: 0 kB`). Elsewhere (no /proc: not Linux) it
does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from collections.abc import Iterable

MADV_DONTNEED = 4  # <sys/mman.h> on Linux
SMAPS = "/proc/self/smaps"


@functools.cache
def _madvise():
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.madvise.restype = ctypes.c_int
    return libc.madvise


def clean_mappings(paths: set[str], smaps: str = SMAPS) -> list[tuple[int, int, int]]:
    """(start, length, resident bytes) of this process's mappings of `paths` (real paths) that hold no written
    page; [] where /proc/self/smaps cannot be read."""
    try:
        with open(smaps) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    found, current = [], None
    for line in lines:
        head = line.split(maxsplit=5)
        if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):  # a mapping's header line
            path = head[5] if len(head) == 6 else ""
            start, end = (int(x, 16) for x in head[0].split("-"))
            current = {"range": (start, end - start), "rss": 0, "anon": 0} if path in paths else None
            if current is not None:
                found.append(current)
        elif current is not None and head and head[0] in ("Rss:", "Anonymous:"):
            current["rss" if head[0] == "Rss:" else "anon"] = int(head[1]) * 1024
    return [(*m["range"], m["rss"]) for m in found if m["anon"] == 0]


def drop_file_pages(paths: Iterable[str]) -> int:
    """Unmap this process's resident pages of the files `paths` where that loses nothing (see the module's
    docstring); -> the resident bytes dropped."""
    real = {os.path.realpath(p) for p in paths}  # a hub cache's snapshot files are links to its blobs
    dropped = 0
    for start, length, resident in clean_mappings(real):
        if resident and _madvise()(start, length, MADV_DONTNEED) == 0:
            dropped += resident
    return dropped
