"""Beside a GPU: host buffers for blocks, and the stream that copies between them and the device.

Every copy between host blocks and the GPU runs on one side stream, so the forward's stream never waits
for a transfer it does not need. Host blocks are slots of a SlotPool: slices of a few large allocations,
pinned beside a GPU (one pinned buffer per block would be rounded up to a power of two by torch's pinned
allocator: a 4.7 MB block would take 8 MB), reused as blocks come and go.
"""

from __future__ import annotations

import bisect
import contextlib
import threading
import time
from collections import deque
from collections.abc import Iterator

import torch

from .blocks import Block

SEGMENT_BYTES = 1 << 28  # one allocation of slots at most: the pinned allocator rounds it to a power of two


class Side:
    """The side stream of one device (none on the CPU, where every copy is synchronous)."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def after_current(self, wait: bool = True) -> Iterator[None]:
        """Run the enclosed work on the side stream, after everything queued so far on the current one (with
        wait; without, after what the side stream was told to wait for before)."""
        if self.stream is None:
            yield
            return
        if wait:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            yield

    def mark(self) -> torch.cuda.Event | None:
        """An event after everything queued so far on the side stream."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    @staticmethod
    def wait(event: torch.cuda.Event | None) -> None:
        """Let the current stream wait for an event (nothing to wait for on the CPU)."""
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def keep(self, tensor: torch.Tensor) -> None:
        """Keep a device tensor's memory from reuse until the side stream's queued work is done."""
        if self.stream is not None:
            tensor.record_stream(self.stream)


class SlotPool:
    """Fixed-size host buffers for blocks, pinned beside a GPU. A slot given back is reused only once every
    copy queued on the side stream before it was given back has finished, so a transfer still reading or
    writing it never sees another block's bytes."""

    def __init__(self, block_bytes: int, side: Side, pinned: bool):
        self.block_bytes, self.side, self.pinned = block_bytes, side, pinned
        self.per_segment = max(1, SEGMENT_BYTES // block_bytes)
        self.segments: list[torch.Tensor] = []
        self.rows: list[torch.Tensor] = []  # each segment as [per_segment, block_bytes]
        self.bases: list[int] = []  # each segment's address, ascending (bisect finds a slot's segment)
        self.free: list[Block] = []
        self.returned: deque[tuple[Block, torch.cuda.Event | None]] = deque()
        self.lock = threading.Lock()
        self.grow_seconds = 0.0  # taking slots past the reserve: new segments allocated (pinned) by the taker

    def take(self) -> Block:
        return self.take_many(1)[0]

    def take_many(self, n: int) -> list[Block]:
        """n slots, in address order: slots that lie side by side in a segment can be filled by one copy
        (spans). The free slots are kept sorted, so a run of free neighbours is taken whole."""
        with self.lock:
            done = None  # the last event found done: slots given back together share one
            while self.returned and ((event := self.returned[0][1]) is None or event is done or event.query()):
                done = event
                bisect.insort(self.free, self.returned.popleft()[0], key=torch.Tensor.data_ptr)
            if len(self.free) < n:
                started = time.perf_counter()
                while len(self.free) < n:
                    self._grow()
                self.grow_seconds += time.perf_counter() - started
            taken = self.free[len(self.free) - n:]
            del self.free[len(self.free) - n:]
        return taken

    def take_grow_seconds(self) -> float:
        """The time spent growing since the last call."""
        with self.lock:
            seconds, self.grow_seconds = self.grow_seconds, 0.0
        return seconds

    def spans(self, slots: list[Block]) -> Iterator[tuple[int, int, torch.Tensor]]:
        """Runs of consecutive blocks of the list that lie side by side, in one segment of the pool or in one
        tensor of their own (a file read into device memory), as (first index, count, one [count,
        block_bytes] tensor over them): one copy moves a run."""
        i = 0
        while i < len(slots):
            start = slots[i].data_ptr()
            s = bisect.bisect_right(self.bases, start) - 1
            row = (start - self.bases[s]) // self.block_bytes if s >= 0 and slots[i].is_cpu else self.per_segment
            if row >= self.per_segment:  # not a slot: a run within the tensor it lies in
                j = i + 1
                while j < len(slots) and self._follows(slots[j - 1], slots[j]):
                    j += 1
                yield i, j - i, (slots[i].view(1, -1) if j == i + 1 else
                                 slots[i].as_strided((j - i, self.block_bytes), (self.block_bytes, 1)))
                i = j
                continue
            j = i + 1
            while (j < len(slots) and row + j - i < self.per_segment
                   and slots[j].data_ptr() == start + (j - i) * self.block_bytes):
                j += 1
            yield i, j - i, self.rows[s][row:row + j - i]
            i = j

    def _follows(self, block: Block, after: Block) -> bool:
        """Whether two blocks of their own (not slots), each one whole row, lie side by side in one tensor."""
        return all(b.is_contiguous() and b.numel() == self.block_bytes for b in (block, after)) and \
            after.data_ptr() == block.data_ptr() + self.block_bytes and after.device == block.device and \
            after.untyped_storage().data_ptr() == block.untyped_storage().data_ptr()

    def give_back(self, *slots: Block) -> None:
        """Slots to reuse once the side stream's queued copies are done: under one event, however many."""
        event = self.side.mark()
        with self.lock:
            self.returned.extend((slot, event) for slot in slots)

    def reserve(self, nbytes: int) -> None:
        """Hold slots for nbytes of blocks (those taken count), in whole segments, now: pinning a segment takes
        milliseconds, which a save or a load would otherwise wait for on the forward thread."""
        with self.lock:
            while len(self.segments) * self.per_segment * self.block_bytes < nbytes:
                self._grow()

    def _grow(self) -> None:
        size = self.per_segment * self.block_bytes
        segment = torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)
        rows = segment.view(self.per_segment, self.block_bytes)
        at = bisect.bisect(self.bases, segment.data_ptr())
        self.segments.insert(at, segment)
        self.rows.insert(at, rows)
        self.bases.insert(at, segment.data_ptr())
        self.free = sorted(self.free + list(rows), key=torch.Tensor.data_ptr)
