"""How blocks cross between vLLM's paged KV cache and host blocks: one transfer path per worker, chosen when
vLLM registers its KV caches.

- HostRows, beside a CPU KV cache: numpy copies each layer's bytes between a block and the layer's byte row
  (a torch op per layer and block costs more than its bytes). Blocks are checked on the host.
- DeviceCopies, beside a GPU (or wherever blocks are checked where the cache lies): copies on the cache's
  device, host copies on the side stream. Block ids are sorted into runs of neighbours, and one op copies
  every layer's slice of every run (a few runs: a step's new blocks, mostly); scattered ids take one gather
  or index_copy_ per layer. With on-device checks a step's saves are checksummed there and copied into pool
  slots, one copy per run of neighbouring slots.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import NamedTuple, TypeVar

import torch

from .blocks import Block, Layout, mix_digests
from .transfer import Side, SlotPool

T = TypeVar("T")
MAX_RUNS = 8  # runs of neighbouring block ids copied slice by slice; more, and a gather per layer costs less


class Saved(NamedTuple):
    """One step's blocks on their way to the save thread."""

    blocks: list[Block]
    digests: torch.Tensor | None = None  # checksums computed on the GPU ([n, 2] int64 on the host); else None
    ready: torch.cuda.Event | None = None  # the copies to the host are done once it has happened


def id_runs(ids: list[int]) -> tuple[list[int], list[tuple[int, int, int]]]:
    """The order that sorts the ids, and the sorted ids' runs of neighbours as (first row, first id, count)."""
    order = sorted(range(len(ids)), key=ids.__getitem__)
    runs: list[tuple[int, int, int]] = []
    for row, i in enumerate(order):
        if runs and runs[-1][1] + runs[-1][2] == ids[i]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((row, ids[i], 1))
    return order, runs


def chunks(items: Iterable[T], n: int) -> Iterator[list[T]]:
    batch: list[T] = []
    for item in items:
        batch.append(item)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


class HostRows:
    """A CPU KV cache: each layer as a [num_blocks, bytes] numpy array, copied row by row."""

    ram_checks_on_load_threads = False  # the model's threads want the cores: handing hashing over cost more

    def __init__(self, layers: dict[str, torch.Tensor], layout: Layout):
        bad = [name for name, t in layers.items() if not t.is_contiguous()]
        if bad:
            raise ValueError(f"kvscope connector: the CPU KV caches of {bad} are not contiguous")
        self.layout = layout
        self.rows = {name: t.view(t.shape[0], -1).view(torch.uint8).numpy() for name, t in layers.items()}

    def extract(self, block_ids: list[int]) -> list[Block]:
        """The blocks' host copies, now: each layer's row into a buffer per block."""
        blocks = [torch.empty(self.layout.nbytes, dtype=torch.uint8) for _ in block_ids]
        for block, block_id in zip(blocks, block_ids):
            row = block.numpy()
            for e in self.layout.entries:
                row[e.start:e.end] = self.rows[e.name][block_id]
        return blocks

    def copy_out(self, block_ids: list[int]) -> Saved:
        """The step's blocks copied out at once (the save thread checksums them)."""
        return Saved(self.extract(block_ids))

    def inject(self, items: Iterable[tuple[int, Block]]) -> int:
        """Host-checked blocks into the KV cache as they come, each layer's bytes straight into its row."""
        count = 0
        for block_id, block in items:
            src = block.numpy()
            for e in self.layout.entries:
                self.rows[e.name][block_id] = src[e.start:e.end]
            count += 1
        return count


class DeviceCopies:
    """A KV cache on a device: blocks gathered and written with one op per layer there. `pool` holds the host
    slots of blocks checked on the device (None: blocks are checked on the host)."""

    ram_checks_on_load_threads = True  # beside a GPU the host's cores are otherwise idle

    def __init__(self, layers: dict[str, torch.Tensor], layout: Layout, side: Side, pool: SlotPool | None,
                 chunk: int):
        self.layers, self.layout, self.side, self.pool, self.chunk = layers, layout, side, pool, chunk
        self.device = next(iter(layers.values())).device
        self.pinned = self.device.type == "cuda"
        self.flat = _flat_rows(layers)
        self.num_blocks = min(t.shape[0] for t in layers.values())

    def index(self, block_ids: list[int]) -> torch.Tensor:
        """Block ids on the KV cache's device. Beside a GPU from pinned memory, without waiting: a copy from
        pageable memory would wait for everything queued on the stream (the forward) first."""
        ids = torch.tensor(block_ids, dtype=torch.long)
        if not self.pinned:
            return ids.to(self.device)
        return ids.pin_memory().to(self.device, non_blocking=True)

    def _runs(self, block_ids: list[int]
              ) -> tuple[dict[str, torch.Tensor], list[int], list[tuple[int, int, int]]] | None:
        """The layers' flat rows, the ids' sort order and runs (id_runs), where few enough runs make slice
        copies the cheaper way."""
        if self.flat is None or not block_ids:
            return None
        order, runs = id_runs(block_ids)
        if runs[0][1] < 0 or runs[-1][1] + runs[-1][2] > self.num_blocks:  # a slice would clip, not fail
            raise IndexError(f"kvscope connector: block ids outside the KV cache's {self.num_blocks} blocks")
        return (self.flat, order, runs) if len(runs) <= MAX_RUNS else None

    def _unsort(self, rows: torch.Tensor, order: list[int]) -> torch.Tensor:
        """Rows in sorted-id order put back in the ids' order (rows as they are when that is already so)."""
        if order == list(range(len(order))):
            return rows
        back = [0] * len(order)
        for row, i in enumerate(order):
            back[i] = row
        return rows.index_select(0, self.index(back))

    def gather(self, block_ids: list[int]) -> torch.Tensor:
        """The blocks packed on the KV cache's device, [blocks, bytes]: one op for every layer's slice of each
        run of neighbouring ids (then one gather into the ids' order), else one gather per layer."""
        n = len(block_ids)
        packed = torch.empty((n, self.layout.nbytes), dtype=torch.uint8, device=self.device)
        if (plan := self._runs(block_ids)) is None:
            idx = self.index(block_ids)
            for e in self.layout.entries:
                packed[:, e.start:e.end] = self.layers[e.name].index_select(0, idx).view(n, -1).view(torch.uint8)
            return packed
        flat, order, runs = plan
        torch._foreach_copy_([packed[r:r + c, e.start:e.end] for e in self.layout.entries for r, _, c in runs],
                             [flat[e.name][b:b + c] for e in self.layout.entries for _, b, c in runs])
        return self._unsort(packed, order)

    def write(self, rows: torch.Tensor, block_ids: list[int]) -> None:
        """Blocks staged on the KV cache's device ([blocks, bytes]) into their slots: rows put in sorted-id
        order (one gather), then one op for every layer's slice of each run, else one index_copy_ per layer."""
        n = len(block_ids)
        if (plan := self._runs(block_ids)) is None:
            idx = self.index(block_ids)
            for e in self.layout.entries:
                self.layers[e.name].index_copy_(0, idx, rows[:, e.start:e.end].view(e.dtype).view(n, *e.shape))
            return
        flat, order, runs = plan
        if order != list(range(len(order))):
            rows = rows.index_select(0, self.index(order))
        torch._foreach_copy_([flat[e.name][b:b + c] for e in self.layout.entries for _, b, c in runs],
                             [rows[r:r + c, e.start:e.end] for e in self.layout.entries for r, _, c in runs])

    def extract(self, block_ids: list[int]) -> list[Block]:
        """The blocks' host copies, now: one gather per layer, then one copy to the host (block by block, a
        GPU model's 36 layers x 60 blocks would be 2160 synchronous copies per prompt)."""
        if not block_ids:
            return []
        packed = self.gather(block_ids)
        host = torch.empty(packed.shape, dtype=torch.uint8, pin_memory=self.pinned)
        host.copy_(packed)
        return list(host)

    def copy_out(self, block_ids: list[int]) -> Saved:
        """The blocks on their way to the host. Checked on the host: copied out now. Checked on the device: a
        chunk at a time, gathered there, checksummed and copied into pool slots on the side stream, one copy
        per run of slots that lie side by side (most of a chunk's, as the pool hands them out in address
        order); nothing here waits for them."""
        if self.pool is None:
            return Saved(self.extract(block_ids))
        slots, sums = [], []
        for chunk in chunks(block_ids, self.chunk):
            packed = self.gather(chunk)
            taken = self.pool.take_many(len(chunk))
            with self.side.after_current():
                sums.append(mix_digests(packed))
                for first, count, host in self.pool.spans(taken):
                    host.copy_(packed[first:first + count], non_blocking=True)
            self.side.keep(packed)
            slots += taken
        if not slots:
            return Saved([])
        with self.side.after_current():
            found = torch.cat(sums)
            digests = torch.empty(found.shape, dtype=torch.int64, pin_memory=self.pool.pinned)
            digests.copy_(found, non_blocking=True)
        return Saved(slots, digests, self.side.mark())

    def inject(self, items: Iterable[tuple[int, Block]]) -> int:
        """Host-checked blocks into the KV cache: each copied to the device as it comes (from pinned memory),
        then one index_copy_ per layer, on the same stream."""
        ids, on_device = [], []
        for block_id, block in items:
            src = block if block.is_pinned() else block.pin_memory()
            on_device.append(src.to(self.device, non_blocking=True))
            ids.append(block_id)
        if ids:
            self.write(torch.stack(on_device), ids)
        return len(ids)


def _flat_rows(layers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """Each layer as [num_blocks, bytes] uint8 views, for slice copies; None where a layer's blocks are not
    each one stretch of memory (then gathers and index_copy_ handle any strides)."""
    try:
        return {name: t.view(t.shape[0], -1).view(torch.uint8) for name, t in layers.items()}
    except RuntimeError:
        return None
