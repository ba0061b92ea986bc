"""What one Locust run replays and how. The bench writes a LocustSpec and hands Locust its path (`--kvscope-spec
FILE`); the locustfile reads it in the master and in every worker process, forked on this host (--processes) or
started on another over ssh (the same path there, as the workload's)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from kvscope.artifacts import Artifact

FLAG = "--kvscope-spec"  # Locust's one kvscope option: the spec's path


class LocustSpec(Artifact):
    workload: str  # the workload JSONL replayed
    records: str  # the JSONL the records are appended to (by the master, or the only process)
    config: str  # the treatment under test, named in every record
    block_size: int  # the server's KV block size in tokens (its manifest's)
    model: str  # the served model name (its manifest's)
    workers: int = 1  # the worker processes that share the workload (1: no workers)
    rate: float = 0.0  # sessions/s, open loop; 0: closed loop
    arrivals: Literal["constant", "poisson"] = "poisson"  # the open loop's gaps
    seed: int = 0  # the Poisson arrivals' seed (each worker adds its index)
    fault: str | None = None  # a canary's fault class, sent with every request
    prompt_ids: bool = False  # keep each prompt's token ids (golden's records)


class LocustWorkers(BaseModel):
    """Locust's distributed mode across hosts: this process is the master, a worker on each host over ssh."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    hosts: list[str]
    ssh_config: str | None = None  # ssh's own config where None
    master_host: str  # the address the workers reach the master at
