"""The TTFT kvscope's client adds: its Locust user against a fake server whose own time to first token is known.

sse_server.py answers every request with a 16-token stream, its first token `--first-ms` after the request's
headers arrived (20 ms, then one every 10 ms: paced like a GPU server), and logs per X-Request-Id when the
headers arrived and when the first token left. A request's added TTFT is the TTFT kvscope's Locust user
recorded minus that server time: connecting, writing the request, the loopback, waking up and parsing the
first chunk. One run at 1, 16 and 64 concurrent streams prints the median, p99, spread (p25-p75) and n of
each; with --processes, each round of as many streams or more also runs with that many Locust processes.
Goal: p99 < 2 ms at 64.

The server runs on the last core and the clients on the others (with two cores or more), so the number is the
client's, not the two processes' contention for one core.

    .venv/bin/python loadtests/benchmarks/client_ttft.py [--processes 2] [--per-stream 16]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import numpy as np
from client_overhead import CORES, PACED, _requests, _server_times, _sse_server, locust_round

from kvscope.run.records import request_key

PORT = 8191
TOKENS = 16


def added_ttft(folder: Path, streams: int, processes: int, requests: int) -> list[float]:
    """Each request's TTFT as kvscope recorded it minus the server's own time to its first token (s)."""
    log = folder / "server-times.jsonl"
    log.write_text("")
    proc, server = _sse_server(PORT, TOKENS, log, PACED)
    try:
        name = f"s{streams}p{processes}"
        recs = locust_round(server, _requests(requests, TOKENS, name), streams, folder, name, processes)
    finally:
        proc.terminate()
        proc.wait()
    served = _server_times(log)
    return [r.ttft_s - served[key] for r in recs if r.ok and r.ttft_s is not None
            and (key := request_key(r.request_id, r.phase)) in served]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--processes", type=int, default=1, help="also run each round with this many Locust processes")
    ap.add_argument("--per-stream", type=int, default=16, help="requests per stream (at least 256 in a round)")
    args = ap.parse_args()
    if len(CORES) > 1:  # Locust inherits this
        os.sched_setaffinity(0, CORES[:-1])
    print(f"fake server: sse_server.py {' '.join(PACED)} ({TOKENS}-token answers) on core {CORES[-1]}; clients on "
          f"cores {CORES[:-1] or CORES}; {os.cpu_count()} cores in all")
    print("streams  processes  added TTFT median    p99   spread (p25-p75)      n   (ms)")
    with tempfile.TemporaryDirectory() as tmp:
        for streams in (1, 16, 64):
            for processes in sorted({1, min(args.processes, streams)}):  # a process without a stream never ends
                ms = np.array(added_ttft(Path(tmp), streams, processes, max(256, streams * args.per_stream))) * 1000
                q25, q50, q75, q99 = np.percentile(ms, [25, 50, 75, 99])
                print(f"{streams:>7}  {processes:>9}  {q50:17.2f}  {q99:5.2f}   {q25:5.2f}-{q75:<5.2f}         "
                      f"{len(ms):>5}", flush=True)
    print("goal: p99 < 2 ms at 64 streams")


if __name__ == "__main__":
    main()
