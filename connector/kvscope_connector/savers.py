"""Saves, one saver per medium a step's blocks go out through, picked once when vLLM registers its KV caches
(worker.register):

- HostSaver: blocks copied out into host buffers of their own (checksummed on the save thread); the RAM tier
  copies what it keeps.
- SlotSaver: beside a GPU, blocks checksummed there and copied into pinned pool slots on the side stream; the
  RAM tier keeps the slots it stores, the others go back to the pool.
"""

from __future__ import annotations

from .blocks import Block
from .loaders import Media
from .paths import DeviceCopies, Saved


class HostSaver:
    owned = False  # the blocks are the saver's own buffers, not slots handed to the RAM tier

    def __init__(self, media: Media):
        self.transfer = media.transfer

    def copy_out(self, block_ids: list[int]) -> Saved:
        return self.transfer.copy_out(block_ids)

    def give_back(self, blocks: list[Block]) -> None:
        """Blocks stored in no RAM: their buffers go with them."""

    def take_grow_seconds(self) -> float:
        return 0.0  # no pool


class SlotSaver:
    owned = True  # each block a pool slot: kept by the RAM tier, or given back

    def __init__(self, media: Media):
        assert isinstance(media.transfer, DeviceCopies) and media.pool is not None, "checks on the device"
        self.transfer, self.pool = media.transfer, media.pool

    def copy_out(self, block_ids: list[int]) -> Saved:
        return self.transfer.copy_out(block_ids)

    def give_back(self, blocks: list[Block]) -> None:
        """Slots stored in no RAM, back to the pool together (one event)."""
        if blocks:
            self.pool.give_back(*blocks)

    def take_grow_seconds(self) -> float:
        """The time the pool grew past its reserve since the last call."""
        return self.pool.take_grow_seconds()
