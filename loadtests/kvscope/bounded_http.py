"""HTTP requests kvscope's probes send to a server (health, /v1/models, /metrics, the warm-up, the reset, golden's
scoring), bounded against a hostile or broken one:

- no redirect is followed: the API key goes to the address the user named and nowhere else (a redirect is an
  error that names where it pointed);
- a deadline for the whole exchange, not only for each socket read: an answer that trickles in a byte at a time
  ends there;
- a cap on the answer's size: an endless or huge answer ends there, its bytes never all held.

The Locust user's requests are bounded by Locust itself (loaduser.py: no redirects, the phase's run time).
"""

from __future__ import annotations

import http.client
import socket
import threading
import urllib.error
from typing import NamedTuple
from urllib.parse import urlsplit

from kvscope import auth

MAX_BYTES = 16 << 20  # a probe's answer: /metrics of a large server is well under 1 MiB


class Refused(urllib.error.URLError):
    """No usable answer: a redirect, an answer too large, the deadline passed, a broken exchange. An OSError
    (URLError is one), so the callers' handling of a dead server covers it."""

    def __str__(self) -> str:
        return str(self.reason)


class Redirected(Refused):
    """A redirect, not followed."""

    def __init__(self, url: str, status: int, location: str | None):
        super().__init__(f"{url} answered {status}, a redirect to {location!r}: kvscope follows no redirect (the "
                         "API key goes to the address given only); give the address that answers")
        self.status = status


class Answer(NamedTuple):
    status: int
    body: bytes


def request(url: str, body: bytes | None = None, timeout: float = 30.0, limit: int = MAX_BYTES) -> Answer:
    """GET `url` (POST `body` when given, as JSON) with the API key; the answer, whatever its status but a
    redirect's. Raises Refused, within `timeout` seconds of the call, when no full answer came."""
    parts = urlsplit(url)
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = kind(parts.hostname or "", parts.port, timeout=timeout)
    expired = threading.Event()
    timer = threading.Timer(timeout, _cut, (conn, expired))
    timer.daemon = True
    timer.start()
    try:
        conn.connect()
        if expired.is_set():  # the deadline passed while connecting, before there was a socket to cut
            raise TimeoutError
        conn.request("GET" if body is None else "POST", parts.path + (f"?{parts.query}" if parts.query else ""),
                     body=body, headers=auth.headers())
        resp = conn.getresponse()
        if 300 <= resp.status < 400:
            raise Redirected(url, resp.status, resp.getheader("Location"))
        data = resp.read(limit + 1)
    except (OSError, http.client.HTTPException) as exc:
        if expired.is_set():
            raise Refused(f"{url}: no full answer within {timeout:g} s") from exc
        if isinstance(exc, Refused):
            raise
        raise Refused(f"{url}: {type(exc).__name__}: {exc}") from exc
    finally:
        timer.cancel()
        conn.close()
    if expired.is_set():
        raise Refused(f"{url}: no full answer within {timeout:g} s")
    if len(data) > limit:
        raise Refused(f"{url}: an answer larger than {limit} bytes")
    return Answer(resp.status, data)


def fetch(url: str, body: bytes | None = None, timeout: float = 30.0, limit: int = MAX_BYTES) -> bytes:
    """request()'s body of a 2xx answer; any other status raises urllib's HTTPError, as urlopen does."""
    status, data = request(url, body, timeout, limit)
    if status >= 400:
        raise urllib.error.HTTPError(url, status, f"HTTP {status}: {data[:200]!r}", None, None)  # type: ignore[arg-type]
    return data


def _cut(conn: http.client.HTTPConnection, expired: threading.Event) -> None:
    """At the deadline: end the exchange where it waits (a read of headers or body, the TLS handshake)."""
    expired.set()
    sock = conn.sock
    if sock is not None:
        try:
            socket.socket.shutdown(sock, socket.SHUT_RDWR)  # the raw socket's, under TLS too
        except OSError:
            pass
