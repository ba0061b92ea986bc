"""A synthetic OpenAI-style streaming server for measuring the load generator itself (benchmarks only).

It answers every POST with a completions SSE stream: the first token chunk immediately, then
`tokens - 1` more as fast as the socket takes them, a usage chunk and [DONE], with chunked transfer
encoding and keep-alive. Because its time to first token is ~0, a client's measured TTFT is the client's
own error. Not a stand-in for vLLM in any test: vLLM on 2 CPU cores cannot stream fast enough to load the
generator.

    python sse_server.py PORT TOKENS
"""

from __future__ import annotations

import asyncio
import json
import sys


def _chunk(payload: bytes) -> bytes:
    return f"{len(payload):x}\r\n".encode() + payload + b"\r\n"


def _event(obj) -> bytes:
    return _chunk(b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n")


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, tokens: int) -> None:
    token = _event({"choices": [{"index": 0, "text": " tok", "token_ids": [7], "finish_reason": None}]})
    tail = _event({"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": tokens,
                                            "prompt_tokens_details": {"cached_tokens": 0}}}) + _event(b"[DONE]")
    while True:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length")), 0)
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + token)
        await writer.drain()
        writer.write(token * (tokens - 1) + tail + b"0\r\n\r\n")
        await writer.drain()


async def main(port: int, tokens: int) -> None:
    async def serve(reader, writer):
        try:
            await handle(reader, writer, tokens)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
