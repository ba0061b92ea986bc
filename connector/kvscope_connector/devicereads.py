"""A file's blocks read straight into GPU memory with NVIDIA's KvikIO, where it imports: GPUDirect Storage
where the host has it, else KvikIO's threaded POSIX reads through its own pinned bounce buffers. A load
checked on the GPU then needs no host slots and no host-to-device copy of its own."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

Read = Callable[[int, torch.Tensor, int], int]  # (an open file, a device tensor, offset) -> bytes read


def kvikio_reads(threads: int) -> Read | None:
    """KvikIO's read of an open file into a device tensor, on `threads` threads of KvikIO's own (unless
    KVIKIO_NTHREADS says otherwise); None where kvikio does not import or its library does not load."""
    try:
        import kvikio
        import kvikio.defaults
    except Exception:  # ImportError, or OSError/RuntimeError from a libkvikio or CUDA that does not load
        return None
    if "KVIKIO_NTHREADS" not in os.environ:
        kvikio.defaults.set("num_threads", threads)

    def read(fd: int, into: torch.Tensor, offset: int) -> int:
        try:  # the file the caller opened and checked, through its fd: its name is not looked up again
            with kvikio.CuFile(f"/proc/self/fd/{fd}", "r") as f:
                return f.pread(into, into.nbytes, offset).get()
        except Exception as exc:  # KvikIO's I/O and CUDA errors, whatever their type: a failed read (store.py
            # judges a file that changed size under it), never a file judged corrupt by the error's type
            raise OSError(f"KvikIO: {type(exc).__name__}: {exc}") from exc
    return read
