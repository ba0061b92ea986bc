"""kvscope's Locust user: takes the next workload session, streams each request, emits one record each.

The user stays thin: `records.parse_stream` defines every measurement. Records leave through Locust's own
channels: a local run appends them to its spec's records file as they finish; a worker sends them to the master
with each `report_to_master` and, when its share is done, in a `kvscope_done` message; the master writes
one merged file and ends the run once every worker is done.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from pathlib import Path

import gevent
import numpy as np
from gevent.queue import Empty, Queue
from locust import FastHttpUser, constant, events, task
from locust.runners import MasterRunner, WorkerRunner

from kvscope import auth
from kvscope.artifacts import read_json
from kvscope.run import orphans, records
from kvscope.run.locustspec import FLAG, LocustSpec
from kvscope.run.records import request_key
from kvscope.run.workload import Request, read_jsonl, sessions

log = logging.getLogger("kvscope")
AUTH = {k: v for k, v in auth.headers().items() if k == "Authorization"}  # the API key, when there is one
LINES_PER_TOKEN = 4  # an SSE event per token is 2 lines (data and a blank one); twice that, for other events


@events.init_command_line_parser.add_listener
def _add_options(parser):
    parser.add_argument(FLAG, default="", help="the LocustSpec the bench wrote: the workload, the records file, the "
                        "config, the arrivals (run/locustspec.py)")


@functools.cache
def _read_spec(path: str) -> LocustSpec:
    return read_json(Path(path), LocustSpec)


def spec(environment) -> LocustSpec:
    """This run's spec, read once per process."""
    return _read_spec(environment.parsed_options.kvscope_spec)


class _Feed:
    """This process's share of the sessions, released at once (closed loop) or by a pacer (open loop)."""

    def __init__(self):
        self.queue: Queue = Queue()
        self.remaining = 0
        self.pacing = False
        self.buffer: list[dict] = []

    def start(self, environment) -> None:
        run = spec(environment)
        index = environment.runner.worker_index if isinstance(environment.runner, WorkerRunner) else 0
        mine = sessions(read_jsonl(Path(run.workload)))[index::max(1, run.workers)]
        self.remaining = len(mine)
        if any(s[0].arrival_s is not None for s in mine):  # a replayed trace: at its own arrival times
            self.pacing = True
            gevent.spawn(self._replay, mine)
        elif run.rate <= 0:
            for s in mine:
                self.queue.put(s)
        else:
            self.pacing = True
            gevent.spawn(self._pace, mine, run.rate, run.arrivals, run.seed + index)
        if not mine:
            self.finish(environment)

    def _pace(self, mine, rate, arrivals, seed) -> None:
        rng = np.random.default_rng(seed)
        for s in mine:
            self.queue.put(s)
            gevent.sleep(rng.exponential(1 / rate) if arrivals == "poisson" else 1 / rate)
        self.pacing = False

    def _replay(self, mine) -> None:
        start = time.monotonic()
        for s in mine:
            gevent.sleep(max(0.0, (s[0].arrival_s or 0.0) - (time.monotonic() - start)))
            self.queue.put(s)
        self.pacing = False

    def next(self) -> list[Request] | None:
        while True:
            try:
                return self.queue.get(timeout=0.2)
            except Empty:
                if not self.pacing:
                    return None

    def done_one(self, environment) -> None:
        self.remaining -= 1
        if self.remaining == 0:
            self.finish(environment)

    def finish(self, environment) -> None:
        runner = environment.runner
        if isinstance(runner, WorkerRunner):
            records_left, self.buffer = self.buffer, []
            runner.send_message("kvscope_done", {"records": records_left})
        else:
            gevent.spawn_later(0.1, runner.quit)


FEED = _Feed()


@events.test_start.add_listener
def _on_start(environment, **_kw):
    if not isinstance(environment.runner, MasterRunner):
        FEED.start(environment)


@events.report_to_master.add_listener
def _send_records(client_id, data):
    data["kvscope_records"], FEED.buffer = FEED.buffer, []


@events.init.add_listener
def _on_init(environment, **_kw):
    runner = environment.runner
    if isinstance(runner, WorkerRunner):  # forked by --processes (or started by ssh): ends with its parent
        orphans.die_with_parent(os.getppid())
    if not isinstance(runner, MasterRunner):
        return
    path = Path(spec(environment).records)
    done: set[str] = set()

    @environment.events.worker_report.add_listener
    def _merge_records(client_id, data):
        if data.get("kvscope_records"):
            records.write(data["kvscope_records"], path)

    def _worker_done(environment, msg, **_kw):
        try:
            records.write(msg.data["records"], path)
        except OSError as exc:  # a full disk: those records are lost, counted, and the run still ends
            log.error("%s: %d records of worker %s not written: %s", records.SESSION_LOST, len(msg.data["records"]),
                      msg.node_id, exc)
        done.add(msg.node_id)
        if len(done) >= spec(environment).workers:
            gevent.spawn_later(0.1, runner.quit)

    runner.register_message("kvscope_done", _worker_done)


class KVScopeUser(FastHttpUser):
    """Replays kvscope workload sessions against one server, streaming every request."""

    wait_time = constant(0)
    insecure = False  # an https server's certificate is checked (the system's CAs, or $SSL_CERT_FILE)
    network_timeout = 300.0
    connection_timeout = 10.0
    max_retries = 0
    max_redirects = 0  # a redirect is a failed request: the API key and the workload go to the server named only

    @task
    def run_session(self) -> None:
        session = FEED.next()
        if session is None:  # nothing left for this user: idle until the last session ends the run
            gevent.sleep(0.5)
            return
        history: list[dict] = []
        try:
            for req in session:
                rec = self._send(req, history if req.with_history else [])
                if req.endpoint == "chat":
                    history += (req.messages or []) + [{"role": "assistant", "content": rec.output_text}]
        except Exception as exc:  # records that cannot be written (a full disk): counted, and the run still ends
            log.error("%s: %s: %s: %s", records.SESSION_LOST, session[0].session_id, type(exc).__name__, exc)
            self.environment.events.request.fire(request_type="SESSION", name=session[0].scenario, response_time=0,
                                                 response_length=0, exception=exc, context={})
        finally:
            FEED.done_one(self.environment)

    def _send(self, req: Request, history: list[dict]) -> records.Record:
        run = spec(self.environment)
        runner = self.environment.runner
        worker = runner.worker_index if isinstance(runner, WorkerRunner) else 0
        path, body = records.request_body(req, history, run.model, fault=run.fault)
        rec = records.new_record(req, run.config, time.time(), worker)
        t0 = time.perf_counter()
        try:
            with self.client.post(path, json=body, stream=True, catch_response=True, name=req.scenario,
                                  headers={**AUTH, "X-Request-Id": request_key(req.request_id, req.phase)}) as resp:
                rec.http_status = resp.status_code or None
                if 300 <= resp.status_code < 400:
                    rec.error = (f"HTTP {resp.status_code}: a redirect to {resp.headers.get('location')!r:.200}, not "
                                 "followed")
                elif resp.status_code != 200:
                    rec.error = f"HTTP {resp.status_code}: {(getattr(resp, 'error', None) or resp.text or '')!s:.200}"
                else:
                    # NOTE: geventhttpclient's read(n) waits for n bytes; readline returns each SSE line as it
                    # arrives, which is what TTFT needs. FastResponse exposes no public line reader.
                    records.parse_stream(_lines(resp._response, req.max_tokens), t0, rec, run.block_size,
                                         run.prompt_ids)
                if rec.e2e_s is not None:
                    resp.request_meta["response_time"] = rec.e2e_s * 1000
                resp.success() if rec.error is None else resp.failure(rec.error)
        except Exception as exc:  # a fault mid-request is a failed record, never a lost run
            rec.error = rec.error or f"{type(exc).__name__}: {exc}"
        rec.ok = rec.error is None
        if rec.ttft_s is not None:
            self.environment.events.request.fire(
                request_type="TTFT", name=req.scenario, response_time=rec.ttft_s * 1000, response_length=0,
                exception=None, context={"request_id": req.request_id, "cached_tokens": rec.cached_tokens})
        self._emit(rec)
        return rec

    def _emit(self, rec: records.Record) -> None:
        if isinstance(self.environment.runner, WorkerRunner):
            FEED.buffer.append(rec.model_dump())
        else:
            records.write([rec], Path(spec(self.environment).records))


def _lines(raw, max_tokens: int):
    """The stream's lines with their arrival times; more than an answer of `max_tokens` tokens takes (a chunk
    per token, and a few more) is an error: an endless stream would grow the record until memory runs out."""
    for _ in range(LINES_PER_TOKEN * (max_tokens + 8)):
        line = raw.readline(b"\n")
        if not line:
            return
        yield time.perf_counter(), line
    raise ValueError(f"a stream longer than max_tokens allow ({max_tokens}): cut off")
