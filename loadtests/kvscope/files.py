"""Files in folders others may have filled (a run folder from someone else, shared storage): read only where
they are regular files, within bounds; written whole or not at all; never through a link.

Every open refuses a symbolic link at the name (O_NOFOLLOW) and anything that is not a regular file (a FIFO, a
device, a socket, a folder), checked on the open descriptor; a FIFO is opened non-blocking, so it cannot hang.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import itertools
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

MAX_LINE_BYTES = 64 << 20  # one JSONL line, or one JSON document
MAX_READ_BYTES = 1 << 30  # one file, as read (a gzipped file inflated)
_REFUSED_OPEN = (errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.ENODEV, errno.EOPNOTSUPP)


class UnsafeFile(ValueError):
    """A name that is not a regular file (a link, a FIFO, a device, a folder), or a file beyond kvscope's bounds;
    the message names the file."""


def _kind(path: Path) -> str:
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return "gone"
    kinds = [(stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a folder"),
             (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")]
    return next((name for test, name in kinds if test(mode)), "a regular file")


def _refuse(path: Path, wanted: str = "a regular file") -> UnsafeFile:
    return UnsafeFile(f"{path}: {_kind(path)}, not {wanted}: kvscope reads and writes only regular files, in "
                      "folders, and follows no link")


def _open(path: Path, flags: int) -> int:
    """A descriptor of the regular file at PATH (never through a link, never blocking on a FIFO)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    except OSError as exc:
        if exc.errno in _REFUSED_OPEN:
            raise _refuse(path) from exc
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _refuse(path)
    return fd


def is_regular(path: Path) -> bool:
    """A regular file at PATH itself (a link to one is not)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def check_folder(path: Path) -> None:
    """Refuse PATH, where it exists, unless it is a folder itself (a link to one is not)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(mode):
        raise _refuse(path, "a folder")


def check_tree(root: Path) -> None:
    """Refuse ROOT unless it is a folder, and anything in it, at any depth, that is not a folder or a regular file
    (a link, a FIFO, a socket, a device): UnsafeFile, naming it."""
    check_folder(root)
    for folder, dirs, names in os.walk(root):  # a link to a folder is listed, never entered
        for path in (Path(folder) / name for name in dirs + names):
            if not is_regular(path) and _kind(path) != "a folder":
                raise _refuse(path, "a folder or a regular file")


def check_regular(path: Path) -> None:
    """Refuse PATH unless it is a regular file (UnsafeFile)."""
    os.close(_open(path, os.O_RDONLY))


def open_read(path: Path) -> BinaryIO:
    return os.fdopen(_open(path, os.O_RDONLY), "rb")


def read_bytes(path: Path, limit: int = MAX_LINE_BYTES) -> bytes:
    """A whole regular file of at most LIMIT bytes."""
    with open_read(path) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise UnsafeFile(f"{path}: larger than {limit >> 20} MiB: refused")
    return data


def lines(path: Path) -> Iterator[bytes]:
    """The lines of a regular file, gunzipped where its name ends in .gz, each with its newline (a last line may
    lack it); a line over MAX_LINE_BYTES, or a file over MAX_READ_BYTES as read, is refused (a gzip bomb)."""
    with open_read(path) as raw, (gzip.GzipFile(fileobj=raw) if str(path).endswith(".gz") else raw) as f:
        total, inflated = 0, " inflated" if f is not raw else ""
        for n in itertools.count(1):
            line = f.readline(MAX_LINE_BYTES + 1)
            if not line:
                return
            total += len(line)
            if len(line) > MAX_LINE_BYTES:
                raise UnsafeFile(f"{path}:{n}: a line longer than {MAX_LINE_BYTES >> 20} MiB: refused")
            if total > MAX_READ_BYTES:
                raise UnsafeFile(f"{path}: more than {MAX_READ_BYTES >> 20} MiB{inflated}: refused")
            yield line


def replace(path: Path, data: str | bytes) -> None:
    """Write PATH whole or not at all (replacing)."""
    with replacing(path) as f:
        f.write(data.encode() if isinstance(data, str) else data)


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[BinaryIO]:
    """A file to write PATH's new content into: a new file beside it (a fresh name, created exclusively),
    flushed to disk and renamed over PATH once the block ends without an error. A link at PATH is replaced,
    never followed; an error, a kill or a full disk on the way leaves the old file as it was."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except IsADirectoryError as exc:
        raise _refuse(path) from exc
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def open_append(path: Path) -> BinaryIO:
    """PATH opened to append to (created where absent), a regular file. A last line cut short (no newline: a
    full disk, a kill) is cut off first, so that what is appended starts a line of its own."""
    fd = _open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT)
    size = os.fstat(fd).st_size
    if size and os.pread(fd, 1, size - 1) != b"\n":
        os.ftruncate(fd, _after_last_newline(fd, size))
    return os.fdopen(fd, "ab")


def _after_last_newline(fd: int, size: int, chunk: int = 1 << 16) -> int:
    """The offset just after the file's last newline (0 where it has none)."""
    end = size
    while end > 0:
        start = max(0, end - chunk)
        at = os.pread(fd, end - start, start).rfind(b"\n")
        if at >= 0:
            return start + at + 1
        end = start
    return 0


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
