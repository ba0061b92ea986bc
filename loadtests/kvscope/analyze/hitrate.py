"""Hit rates three ways: per request (server usage), per phase (server counters), and theoretical.

The theoretical rate replays the run's own block-hash trace, in arrival order, through an LRU of the
server's KV capacity: what a prefix cache of that size could have hit. Like vLLM, a request can hit at
most its full blocks before its last token ((prompt_tokens - 1) // block_size blocks), and a hit must be
a leading run of blocks. It ignores the room that running requests and decode tokens take.
"""

from __future__ import annotations

from collections import OrderedDict

from kvscope.artifacts import Record


def theoretical(records: list[Record], capacity_tokens: int | None, block_size: int) -> float | None:
    """Hit rate (cached / prompt tokens) of the measure phase through an LRU prefix cache that the prime phase
    filled first (nothing resets between them); capacity None means unbounded."""
    trace = sorted((r for r in records if r.ok and r.prompt_tokens), key=lambda r: r.start_unix_s)
    if not any(r.phase == "measure" for r in trace):
        return None
    capacity = None if capacity_tokens is None else max(1, capacity_tokens // block_size)
    lru: OrderedDict[str, None] = OrderedDict()
    hit_tokens = prompt_tokens = 0
    for r in trace:
        assert r.prompt_tokens  # the trace holds only records with prompt tokens
        usable = r.prompt_block_hashes[: max(0, (r.prompt_tokens - 1) // block_size)]
        hits = 0
        for h in usable:
            if h not in lru:
                break
            hits += 1
        if r.phase == "measure":
            hit_tokens += hits * block_size
            prompt_tokens += r.prompt_tokens
        for h in r.prompt_block_hashes:
            lru[h] = None
            lru.move_to_end(h)
            if capacity is not None and len(lru) > capacity:
                lru.popitem(last=False)
    return hit_tokens / prompt_tokens


def per_request(records: list[Record]) -> float | None:
    """Server-reported cached tokens over prompt tokens, over the requests that reported both."""
    rows = [(r.cached_tokens, r.prompt_tokens) for r in records
            if r.ok and r.cached_tokens is not None and r.prompt_tokens]
    return sum(c for c, _ in rows) / sum(p for _, p in rows) if rows else None
