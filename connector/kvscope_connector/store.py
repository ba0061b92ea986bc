"""Block storage: a RAM tier in front of a filesystem tier, both verified on every load.

Both tiers answer the same protocol (Tier): contains, get (a verified block with its checksum, None when
absent, CorruptBlock when stored but not what this server expects), put, discard and clear. Files are the
format of fileformat.py; writes are atomic (a temp file created exclusively under a random name, optional
fsync, rename), so a reader on a shared directory never sees a torn block and a planted link is never
followed. Directories are 0700 and files 0600. Anything that does not verify is a miss: counted, moved
aside once, never loaded.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import stat
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from .blocks import Block, CorruptBlock, Layout, checksum
from .fileformat import MAX_HEADER, decode, header
from .transfer import SlotPool

log = logging.getLogger("kvscope_connector")
MAX_PER_FILE = 256  # blocks a file may hold: a file is read and written with one call (the system's limit on
# buffers a call takes is 1024)
STALE_TMP_S = 3600  # a temp file untouched this long is a save that never finished (its writer was killed): a
# live writer, on this host or another sharing the store, renames its file within seconds


@dataclass
class Stats:
    """Counters of one worker since the last report; see connector.KVScopeStats."""

    ram_hits: int = 0
    fs_hits: int = 0
    misses: int = 0
    corrupt: int = 0  # checksum, header, shape/dtype, fingerprint or truncation failures
    io_errors: int = 0
    saves: int = 0
    save_errors: int = 0
    saves_skipped: int = 0  # files not written because the save thread was behind: later misses
    load_bytes: int = 0
    save_bytes: int = 0
    load_seconds: float = 0.0  # the forward thread in load(), once the loaded keys' pending saves are in; of it
    load_read_wait_seconds: float = 0.0  # waiting for the load threads (their reads, and checks on the host)
    load_device_wait_seconds: float = 0.0  # waiting for the GPU: its queue up to a chunk's checksums, read back
    save_seconds: float = 0.0  # copies issued and stored, on either thread
    save_forward_seconds: float = 0.0  # the forward thread in save() (backlog waits included)
    save_wait_seconds: float = 0.0  # the forward thread waiting for the save thread (its backlog full)
    pool_grow_seconds: float = 0.0  # the slot pool growing past its reserve, on the thread taking the slots
    evictions: int = 0  # RAM blocks and files
    stale_tmp_removed: int = 0  # temp files of saves that never finished, removed at start (FsTier)
    logged: set = field(default_factory=set)

    def add(self, other: Stats) -> None:
        for f in fields(self):
            if f.name != "logged":
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def take(self) -> Stats:
        """The counts so far, zeroed here: whoever holds this object (the worker's loader) counts on into it."""
        taken = replace(self)
        for f in fields(self):
            if f.name != "logged":
                setattr(self, f.name, f.default)
        return taken

    def warn_once(self, kind: str, msg: str, *args) -> None:
        if kind not in self.logged:
            self.logged.add(kind)
            log.warning("kvscope connector: " + msg + " (further %s events are counted, not logged)", *args, kind)


def _write_fully(fd: int, buffers: list) -> None:
    """Write the buffers in order, as many writes as it takes (a write may take less)."""
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        got = os.writev(fd, views)
        while views and got >= len(views[0]):
            got -= len(views.pop(0))
        if views:
            views[0] = views[0][got:]


def _read_fully(fd: int, buffers: list, offset: int) -> int:
    """Fill the buffers from the file at offset, as many reads as it takes (a read may return less, on NFS or
    FUSE); returns the bytes read, fewer only where the file ends first."""
    views = [memoryview(b).cast("B") for b in buffers]
    total = 0
    while views and (got := os.preadv(fd, views, offset + total)):
        total += got
        while views and got >= len(views[0]):
            got -= len(views.pop(0))
        if views:
            views[0] = views[0][got:]
    return total


class Tier(Protocol):
    def contains(self, key: str) -> bool: ...

    def get(self, key: str, verify: bool = True) -> tuple[Block, str] | None:
        """The stored block with its checksum, None when absent; verified, unless the caller checks the
        checksum itself (on the GPU). Raises CorruptBlock when the block fails verification and OSError when
        the tier cannot be read."""

    def put(self, key: str, block: Block, digest: str) -> int:
        """Store a copy of a block with its checksum; returns how many blocks were evicted to make room."""

    def discard(self, key: str) -> None:
        """Forget a block that failed verification, so it is neither loaded nor looked up again."""

    def clear(self) -> None: ...


class RamTier:
    """LRU of verified blocks in host memory, bounded in bytes; used by the forward and the save thread.
    Beside a GPU its blocks are slots of the worker's pinned SlotPool, which copies to the GPU read from
    directly."""

    def __init__(self, capacity_bytes: int):
        self.capacity = capacity_bytes
        self.pool: SlotPool | None = None  # beside a GPU, with on-device checks (attach)
        self.pin = False  # without a pool beside a GPU (host checks): copies in pinned memory of their own
        self.checksum: Callable[[Block], str] = checksum  # the platform's (keys.fingerprint names it)
        self.used = 0
        self.blocks: OrderedDict[str, tuple[Block, str]] = OrderedDict()
        self.dropped: list[Block] = []  # slots it no longer holds, given back by the forward thread (release)
        self.lock = threading.Lock()

    def attach(self, pool: SlotPool | None, checksum: Callable[[Block], str], pin: bool) -> None:
        """What the worker knows once vLLM registers its KV caches (vLLM builds the connector before them):
        the pool whose slots hold blocks, the platform's checksum, and whether copies are pinned."""
        self.pool, self.checksum, self.pin = pool, checksum, pin

    def contains(self, key: str) -> bool:
        with self.lock:
            return key in self.blocks

    def put(self, key: str, block: Block, digest: str, owned: bool = False) -> int:
        """Store a block; returns how many blocks were evicted to make room (put_many)."""
        return self.put_many([(key, block, digest)], owned)

    def put_many(self, items: list[tuple[str, Block, str]], owned: bool = False) -> int:
        """Store blocks (key, block, checksum) in order; returns how many blocks were evicted to make room. An
        owned block (a pool slot the caller hands over) is kept as it is, or given back to the pool when it
        is not kept, with the evicted ones (release); any other block is copied (with numpy: torch
        would start an OpenMP team on the save thread, and with more OpenMP threads than cores libgomp stops
        spinning in every team, the model's too: its forward on 2 cores went from 12.6 to 18.5 ms)."""
        evicted, back = 0, []
        with self.lock:
            for key, block, digest in items:
                size = block.numel()
                if size > self.capacity or key in self.blocks:
                    if key in self.blocks:
                        self.blocks.move_to_end(key)
                    if owned:
                        back.append(block)
                    continue
                while self.used + size > self.capacity:
                    back.append(self._drop(next(iter(self.blocks))))
                    evicted += 1
                if not owned:
                    into = self.pool.take() if self.pool is not None else torch.empty(size, dtype=torch.uint8,
                                                                                      pin_memory=self.pin)
                    np.copyto(into.numpy(), block.numpy())
                    block = into
                self.blocks[key] = (block, digest)
                self.used += size
            self._give_back(back)
        return evicted

    def get(self, key: str, verify: bool = True) -> tuple[Block, str] | None:
        """The block and its checksum; with verify, only if its bytes still match that checksum (a stray
        write into the tier would otherwise be loaded), checked on the caller's thread. Without, the caller
        checks it (on the GPU, after the copy)."""
        with self.lock:
            if key not in self.blocks:
                return None
            self.blocks.move_to_end(key)
            block, digest = self.blocks[key]
        if verify and self.checksum(block) != digest:
            raise CorruptBlock("RAM block failed its checksum")
        return block, digest

    def peek(self, key: str) -> Block | None:
        """The block stored under key, or None, leaving the LRU order as it is (the canary's former owner)."""
        with self.lock:
            held = self.blocks.get(key)
        return None if held is None else held[0]

    def recent(self, excluding: set[str]) -> Block | None:
        """The most recently used block stored under a key not in `excluding` (the canary's foreign block)."""
        with self.lock:
            return next((block for key, (block, _) in reversed(self.blocks.items()) if key not in excluding), None)

    def discard(self, key: str) -> None:
        self.drop(key)

    def drop(self, key: str) -> bool:
        return self.drop_many([key]) == 1

    def drop_many(self, keys: list[str]) -> int:
        """Forget the blocks stored under keys (their slots go back on release()); returns how many were
        stored."""
        with self.lock:
            return self._give_back([self._drop(key) for key in keys if key in self.blocks])

    def _drop(self, key: str) -> Block:
        """Forget a stored block; the caller hands its slot to _give_back."""
        block, _ = self.blocks.pop(key)
        self.used -= block.numel()
        return block

    def _give_back(self, slots: list[Block]) -> int:
        """Slots the tier no longer holds, kept until release(): a load may have looked one up and not yet
        queued its copy."""
        if self.pool is not None:
            self.dropped += slots
        return len(slots)

    def release(self) -> None:
        """Give the slots dropped so far back to the pool, under one event: on the forward thread, once the
        copies of every block it looked up are queued (after a load's checked chunk, before a save)."""
        with self.lock:
            dropped, self.dropped = self.dropped, []
        if dropped and self.pool is not None:
            self.pool.give_back(*dropped)

    def clear(self) -> None:
        with self.lock:
            self._give_back([self._drop(key) for key in list(self.blocks)])


class FsTier:
    """Blocks as files under root/<fingerprint>/<key[:2]>/<key>.safetensors, a file holding one or several
    consecutive blocks of a prompt and named by its last block's key; LRU by access within a byte cap. The
    scheduler side only looks files up; the worker side, which knows the Layout, reads and writes."""

    def __init__(self, root: str, fingerprint: str, capacity_bytes: int | None, fsync: bool = False,
                 layout: Layout | None = None, secret: bytes | None = None, per_file: int = 1):
        if type(per_file) is not int or not 1 <= per_file <= MAX_PER_FILE:
            raise ValueError(f"kvscope connector: {per_file!r} blocks per file, not 1 to {MAX_PER_FILE} (file_tokens "
                             "is a multiple of the block size)")
        if capacity_bytes is not None and (type(capacity_bytes) is not int or capacity_bytes < 0):
            raise ValueError(f"kvscope connector: fs_bytes {capacity_bytes!r} is not a number of bytes (an integer "
                             "such as 17179869184; absent: unbounded)")
        self.root = Path(root)
        self.dir = self.root / fingerprint
        self.fingerprint = fingerprint
        self.secret = secret  # signs and verifies every file (fileformat.mac) when set
        self.capacity = capacity_bytes
        self.fsync = fsync
        self.per_file = per_file  # blocks a file holds (scheduler.py: which ones)
        self.layout = layout  # the worker's, once vLLM registers its KV caches (attach)
        self.pool: SlotPool | None = None  # beside a GPU: blocks are read into its pinned slots (attach)
        self.checksum: Callable[[Block], str] = checksum
        self.sizes: OrderedDict[str, int] = OrderedDict()  # what this process knows is on disk, LRU order
        self.used = 0
        self.lock = threading.Lock()  # the accounting is shared by the load threads and the writer threads
        self.writing: set[str] = set()  # keys a writer is storing: not evicted under it
        self._private_root()
        self.stale_tmp_removed = 0  # temp files left by saves that never finished, removed at start
        for _, key, size in sorted(self._on_disk()):
            self._note(key, size)
        if self.stale_tmp_removed:
            log.warning("kvscope connector: removed %d temp files of saves that never finished from %s",
                        self.stale_tmp_removed, self.dir)

    def _private_root(self) -> None:
        """A root that already exists keeps no group or other access: made 0700 where this user owns it,
        refused where others may write it and this user cannot tighten it (whoever can write the root can
        swap the store's folders). A root that does not exist yet is made 0700 with the first write."""
        try:
            st = os.stat(self.root)
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(st.st_mode) or not st.st_mode & 0o077:
            return
        if st.st_uid == os.getuid():
            os.chmod(self.root, 0o700)
            log.warning("kvscope connector: the store root %s had mode %o; made 0700", self.root, st.st_mode & 0o777)
        elif st.st_mode & 0o022:
            raise ValueError(f"kvscope connector: the store root {self.root} has mode {st.st_mode & 0o777:o} (others "
                             "may write it) and another user owns it; give this server a folder of its own, 0700")

    def attach(self, pool: SlotPool | None, checksum: Callable[[Block], str], layout: Layout) -> None:
        """What the worker knows once vLLM registers its KV caches (vLLM builds the connector before them, and
        the scheduler side, which only looks keys up, never learns it): the pool blocks are read into, the
        platform's checksum and the blocks' layout."""
        self.pool, self.checksum, self.layout = pool, checksum, layout

    def _on_disk(self) -> list[tuple[float, str, int]]:
        """(mtime, key, size) of the block files already stored; links and other files are not blocks. Temp
        files untouched for STALE_TMP_S are saves that never finished: removed and counted."""
        found = []
        try:
            shards = [e.path for e in os.scandir(self.dir) if e.is_dir(follow_symlinks=False)]
        except OSError:
            return []
        for shard in shards:
            try:
                for e in os.scandir(shard):
                    if e.name.endswith(".safetensors") and e.is_file(follow_symlinks=False):
                        st = e.stat(follow_symlinks=False)
                        found.append((st.st_mtime, e.name.removesuffix(".safetensors"), st.st_size))
                    elif e.name.endswith(".tmp") and e.is_file(follow_symlinks=False) and self._stale(e):
                        with contextlib.suppress(FileNotFoundError):  # another server's start took it first
                            os.unlink(e.path)
                            self.stale_tmp_removed += 1
            except OSError:
                continue
        return found

    @staticmethod
    def _stale(entry: os.DirEntry) -> bool:
        try:
            return time.time() - entry.stat(follow_symlinks=False).st_mtime > STALE_TMP_S
        except FileNotFoundError:  # renamed into place, or removed, since the listing
            return False

    def _folder(self, key: str, create: bool = False) -> int:
        """A descriptor of the key's folder, root/<fingerprint>/<key[:2]>, reached without following a link
        below the root (one there would send blocks, prompts' KV, into and out of its target); with create,
        what is missing is made 0700. Raises OSError (ELOOP or ENOTDIR at a link)."""
        try:
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            if not create:
                raise
            os.makedirs(self.root, mode=0o700, exist_ok=True)
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for name in (self.fingerprint, key[:2]):
                try:
                    inner = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(name, 0o700, dir_fd=fd)
                    inner = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                os.close(fd)
                fd = inner
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _name(self, key: str) -> str:
        return f"{self.dir}/{key[:2]}/{key}.safetensors"

    def path(self, key: str) -> Path:
        return Path(self._name(key))

    def contains(self, key: str) -> bool:
        return os.path.isfile(self._name(key))  # a stat per block on the scheduler's hot path: no pathlib

    def _note(self, key: str, size: int) -> None:
        with self.lock:
            self.used += size - self.sizes.pop(key, 0)
            self.sizes[key] = size

    def _layout(self) -> Layout:
        if self.layout is None:
            raise RuntimeError("kvscope connector: the filesystem tier has no layout before the KV caches exist")
        return self.layout

    def put(self, key: str, block: Block, digest: str) -> int:
        """Atomically write one block as a file of its own; returns how many files were evicted."""
        return self.put_file(key, [(key, block, digest)])

    def put_file(self, file: str, blocks: list[tuple[str, Block, str]]) -> int:
        """Atomically write consecutive blocks of a prompt, (key, block, checksum) each, as one file named by
        `file` (the last block's key); returns how many files were evicted. Raises OSError on I/O faults."""
        keys, data, digests = zip(*blocks)
        head = header(list(data), self._layout(), self.fingerprint, file, list(keys), list(digests), self.secret)
        with self.lock:
            self.writing.add(file)
        try:
            self._write(file, head, list(data))
        finally:
            with self.lock:
                self.writing.discard(file)
        return self._evict()

    def _write(self, file: str, head: bytes, blocks: list[Block]) -> None:
        """The file's bytes under a temp name created exclusively, then renamed into place: the header and
        then each block's own buffer (a pinned slot beside a GPU), in one writev and no copy."""
        name, tmp = f"{file}.safetensors", f".{file}.safetensors.{secrets.token_hex(8)}.tmp"  # unique across hosts
        folder = self._folder(file, create=True)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=folder)
            try:
                try:
                    _write_fully(fd, [head, *(block.numpy() for block in blocks)])
                    if self.fsync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
            except OSError:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp, dir_fd=folder)
                raise
        finally:
            os.close(folder)
        self._note(file, len(head) + sum(block.numel() for block in blocks))

    def _remove(self, key: str, aside: bool = False) -> None:
        """Delete a key's file, or move it aside (`.corrupt`), inside its own folder only; a file already gone,
        or a folder that is missing or a link, is left alone."""
        try:
            folder = self._folder(key)
        except OSError:
            return
        name = f"{key}.safetensors"
        try:
            if aside:
                os.replace(name, f"{key}.corrupt", src_dir_fd=folder, dst_dir_fd=folder)
            else:
                os.unlink(name, dir_fd=folder)
        except OSError:
            pass
        finally:
            os.close(folder)

    def _evict(self) -> int:
        evicted = 0
        with self.lock:
            while self.capacity is not None and self.used > self.capacity and len(self.sizes) > 1:
                key = next((k for k in self.sizes if k not in self.writing), None)
                if key is None:
                    break
                self.used -= self.sizes.pop(key)
                self._remove(key)
                evicted += 1
        return evicted

    def get(self, key: str, verify: bool = True, into: Block | None = None) -> tuple[Block, str] | None:
        """A block stored in a file of its own (get_file of one block)."""
        found = self.get_file(key, [key], 0, 1, verify, None if into is None else [into])
        return None if found is None else found[0]

    @contextlib.contextmanager
    def _opened(self, file: str, count: int) -> Iterator[tuple[int, int, int] | None]:
        """The file of `count` blocks named `file`, opened for reading: (fd, its size, its header's length), None
        when there is no such file. A link is not followed, and its type and size are checked against the
        layout before anything is read. The fd is closed after the block, and a read that raised nothing is
        noted (_note)."""
        try:  # never blocks: a FIFO planted here would otherwise wait for a writer
            fd = os.open(self._name(file), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            yield None
            return
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise CorruptBlock("a symbolic link, not a block file") from exc
            if exc.errno == errno.ENXIO:  # what opening a socket (or a device with none behind it) says
                raise CorruptBlock("a socket or a device, not a block file") from exc
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):  # a FIFO, a device, a folder
                raise CorruptBlock(f"not a regular file (mode {st.st_mode:o})")
            # the header's length follows from the file's size, and the file must then say it
            size, data = st.st_size, count * self._layout().nbytes
            n = size - 8 - data
            if not 0 <= n <= MAX_HEADER:
                raise CorruptBlock(f"{size} bytes, not 8 + a header of at most {MAX_HEADER} + {count} blocks of "
                                   f"{self._layout().nbytes} (truncated or padded)")
        except BaseException:
            os.close(fd)
            raise
        try:
            yield fd, size, n
        finally:
            os.close(fd)
        self._note(file, size)

    def get_file(self, file: str, keys: list[str], first: int, count: int, verify: bool = True,
                 into: list[Block] | None = None) -> list[tuple[Block, str]] | None:
        """Read and check blocks first, first + 1, ... (stored under `keys`) of the file of `count` blocks named
        `file`, None when there is no such file (_opened's checks first), the header checked whole (a store
        secret's MACs included); the checksums too, unless the caller checks them itself (on the GPU). The
        blocks are read into `into` (slots the caller owns, whatever happens), else pool slots where the
        worker has a pool (the caller then owns them), else buffers of their own: with the header in one read
        when they begin the file."""
        layout = self._layout()
        with self._opened(file, count) as opened:
            if opened is None:
                return None
            fd, size, n = opened
            head = bytearray(8 + n)
            pool = self.pool if into is None else None  # slots taken here: given back if the read fails
            blocks = into if into is not None else pool.take_many(len(keys)) if pool is not None else [
                torch.empty(layout.nbytes, dtype=torch.uint8) for _ in keys]
            try:
                bufs = [block.numpy() for block in blocks]
                want = len(keys) * layout.nbytes
                if first == 0:
                    got = _read_fully(fd, [head, *bufs], 0) - len(head)
                elif _read_fully(fd, [head], 0) == len(head):
                    got = _read_fully(fd, bufs, len(head) + first * layout.nbytes)
                else:
                    got = -1
                if got != want:
                    raise CorruptBlock("the file shrank while it was read")
                return self._decode(head, n, size, blocks, file, keys, first, count, verify)
            except BaseException:
                if pool is not None:
                    for block in blocks:
                        pool.give_back(block)
                raise

    def get_file_to(self, file: str, keys: list[str], first: int, count: int, into: torch.Tensor,
                    read: Callable[[int, torch.Tensor, int], int]) -> list[tuple[Block, str]] | None:
        """get_file's blocks, read by `read(fd, into, offset)` into `into` (one row a block: KvikIO's read into
        GPU memory) once the file passed _opened's checks and its header is read and checked here, each block's
        key against `keys`; the checksums are returned for the caller to check on the GPU. Not with a store
        secret, whose MACs are computed over the blocks' bytes on the host."""
        assert self.secret is None, "a store secret's MACs are checked on the host (get_file)"
        layout = self._layout()
        with self._opened(file, count) as opened:
            if opened is None:
                return None
            fd, size, n = opened
            head = bytearray(8 + n)
            if _read_fully(fd, [head], 0) != len(head):
                raise CorruptBlock("the file shrank while it was read")
            found = self._decode(head, n, size, list(into), file, keys, first, count, verify=False)
            try:
                got = read(fd, into, len(head) + first * layout.nbytes)
            except OSError:  # KvikIO raises at the end of a file, where get_file counts bytes
                if os.fstat(fd).st_size != size:
                    raise CorruptBlock("the file changed size while it was read") from None
                raise
            if got != len(keys) * layout.nbytes:
                raise CorruptBlock("the file shrank while it was read")
            return found

    def _decode(self, head: bytearray, n: int, size: int, blocks: list[Block], file: str, keys: list[str],
                first: int, count: int, verify: bool) -> list[tuple[Block, str]]:
        if (said := struct.unpack_from("<Q", head)[0]) != n:
            raise CorruptBlock(f"{size} bytes, expected {size - n + said} (truncated or padded)")
        return decode(bytes(head), blocks, self.fingerprint, file, keys, first, count, self._layout(), self.secret,
                      self.checksum if verify else None)

    def discard(self, key: str) -> None:
        """Move a block that failed verification aside (`.corrupt`): kept for inspection, never looked up."""
        self._remove(key, aside=True)
        with self.lock:
            self.used -= self.sizes.pop(key, 0)

    def clear(self) -> None:
        """The filesystem tier outlives a reset: other servers may share it, and its files stay valid."""
