"""A synthetic OpenAI-style streaming server for measuring the load generator itself (benchmarks only).

It answers every POST with a completions SSE stream: the first token chunk, then `tokens - 1` more, a
usage chunk and [DONE], with chunked transfer encoding and keep-alive. By default every token leaves as
fast as the socket takes it (the client is the bottleneck); with --first-ms/--token-ms the first token
waits that long after the request arrived and the others follow at that interval, as a GPU server's do.
With LOG, it appends one line per request: its X-Request-Id, when its headers were
read and when its first token left (time.time()), so a client's TTFT can be split into the server's part
and the client's own. Not a stand-in for vLLM in any test: vLLM on 2 CPU cores cannot stream fast enough to
load the generator.

    python sse_server.py PORT TOKENS [LOG] [--first-ms MS --token-ms MS]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time


def _chunk(payload: bytes) -> bytes:
    return f"{len(payload):x}\r\n".encode() + payload + b"\r\n"


def _event(obj) -> bytes:
    return _chunk(b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n")


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, tokens: int, log, first_s: float,
                 token_s: float) -> None:
    token = _event({"choices": [{"index": 0, "text": " tok", "token_ids": [7], "finish_reason": None}]})
    tail = _event({"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": tokens,
                                            "prompt_tokens_details": {"cached_tokens": 0}}}) + _event(b"[DONE]")
    while True:
        head = await reader.readuntil(b"\r\n\r\n")
        received = time.time()
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(b":") for line in head.split(b"\r\n"))}
        await reader.readexactly(int(headers.get(b"content-length", 0)))
        if first_s:
            await asyncio.sleep(first_s - (time.time() - received))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + token)
        await writer.drain()
        if log is not None:
            log.write(json.dumps({"id": headers.get(b"x-request-id", b"").decode(), "received": received,
                                  "first_sent": time.time()}) + "\n")
        if token_s:
            for _ in range(tokens - 1):
                await asyncio.sleep(token_s)
                writer.write(token)
            writer.write(tail + b"0\r\n\r\n")
        else:
            writer.write(token * (tokens - 1) + tail + b"0\r\n\r\n")
        await writer.drain()


async def main(port: int, tokens: int, log_path: str | None, first_s: float, token_s: float) -> None:
    log = open(log_path, "a", buffering=1) if log_path else None  # noqa: SIM115  (open while serving)

    async def serve(reader, writer):
        try:
            await handle(reader, writer, tokens, log, first_s, token_s)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("port", type=int)
    ap.add_argument("tokens", type=int)
    ap.add_argument("log", nargs="?")
    ap.add_argument("--first-ms", type=float, default=0.0, help="delay of the first token after the request")
    ap.add_argument("--token-ms", type=float, default=0.0, help="interval between the other tokens")
    a = ap.parse_args()
    asyncio.run(main(a.port, a.tokens, a.log, a.first_ms / 1000, a.token_ms / 1000))
