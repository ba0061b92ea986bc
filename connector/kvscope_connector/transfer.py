"""Beside a GPU: host buffers for blocks, and the stream that copies between them and the device.

Every copy between host blocks and the GPU runs on one side stream, so the forward's stream never waits
for a transfer it does not need. Host blocks are slots of a SlotPool: slices of a few large allocations,
pinned beside a GPU (one pinned buffer per block would be rounded up to a power of two by torch's pinned
allocator: a 4.7 MB block would take 8 MB), reused as blocks come and go.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Iterator

import torch

from .blocks import Block

SEGMENT_BYTES = 1 << 28  # one allocation of slots: a power of two, so the pinned allocator rounds nothing


class Side:
    """The side stream of one device (none on the CPU, where every copy is synchronous)."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def after_current(self) -> Iterator[None]:
        """Run the enclosed work on the side stream, after everything queued so far on the current one."""
        if self.stream is None:
            yield
            return
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
        self.free: list[Block] = []
        self.returned: deque[tuple[Block, torch.cuda.Event | None]] = deque()
        self.lock = threading.Lock()

    def take(self) -> Block:
        with self.lock:
            while self.returned and (self.returned[0][1] is None or self.returned[0][1].query()):
                self.free.append(self.returned.popleft()[0])
            if not self.free:
                self._grow()
            return self.free.pop()

    def give_back(self, slot: Block) -> None:
        event = self.side.mark()
        with self.lock:
            self.returned.append((slot, event))

    def _grow(self) -> None:
        size = self.per_segment * self.block_bytes
        segment = torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)
        self.segments.append(segment)
        self.free += list(segment.view(self.per_segment, self.block_bytes))
