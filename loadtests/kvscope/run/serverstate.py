"""A server's state between treatments: warmed up, reset (vLLM's prefix cache, the connector's cache, and the
config's stores wiped), probed for being empty, restarted by the user's command.

Every step says what it did, for the treatment's status row; none raises on a dead server (its failed records
say so in the treatment itself).
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import time
import urllib.error
from pathlib import Path

from kvscope import bounded_http
from kvscope.artifacts import Reset, RestartPhase, Treatment
from kvscope.deploy.folder import DeploymentFolder
from kvscope.run import probe

WARM_UP_S = 300.0  # an idle CPU server's first answer; at most --timeout-s


def _post(url: str, timeout: float = 60) -> int:
    """The HTTP status of an empty POST (a redirect's own: it is not followed)."""
    try:
        return bounded_http.request(url, b"", timeout).status
    except bounded_http.Redirected as exc:
        return exc.status


def empty_caches(server: Treatment) -> int | str:
    """Empty vLLM's prefix cache and the connector's (POST /reset_prefix_cache?reset_external=true), the stores'
    files left; the HTTP status, or the error's name."""
    try:
        return _post(f"{server.url}/reset_prefix_cache?reset_external=true")
    except (urllib.error.URLError, OSError) as exc:
        return type(exc).__name__


def reset(server: Treatment) -> Reset:
    """Empty every tier of one server: vLLM's prefix cache, the connector's cache, the config's stores."""
    status = empty_caches(server)
    wiped, refused = [], []
    root = DeploymentFolder(Path(server.run_dir).resolve()).stores if server.run_dir else None
    for name in sorted(server.manifest.stores) if server.manifest.store_reset == "wipe" else []:
        path = Path(server.manifest.stores[name]).resolve()
        if root is None or path == root or not path.is_relative_to(root):
            refused.append(name)  # a manifest pointing outside the run's stores folder: wipe nothing there
            continue
        if why := _wipe(path):
            refused.append(f"{name}: {why}")
        else:
            wiped.append(name)
    done = Reset(reset_prefix_cache_http=status, stores_wiped=wiped)
    if refused:
        done.stores_refused = refused
    return done


def _wipe(path: Path, passes: int = 20) -> str:
    """Remove everything under a store folder; "" when done, else why not. The live server may still be
    writing there (a connector's saves from the treatment before and from the warm-up land a moment after
    the reset), so what vanishes or refills meanwhile is removed again, a pass at a time."""
    error: OSError | None = None
    for _ in range(passes):
        try:
            for child in path.glob("*"):
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink(missing_ok=True)
            return ""
        except OSError as exc:  # a file gone before its removal, or a folder refilled during it
            error = exc
            time.sleep(0.25)
    return f"still being written after {passes} passes ({error})"


def restart(server: Treatment, command: str) -> RestartPhase:
    """Restart a server between phases with the user's command ({config} filled in; no shell); what it did."""
    started = time.monotonic()
    argv = shlex.split(command.replace("{config}", server.deployed_as))
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
        code, tail = done.returncode, (done.stdout + done.stderr).strip().splitlines()[-3:]
    except (OSError, subprocess.TimeoutExpired) as exc:
        code, tail = None, [f"{type(exc).__name__}: {exc}"]
    return RestartPhase(restart_exit=code, seconds=round(time.monotonic() - started, 1), tail=tail if code else [])


def warm_up(server: Treatment, timeout_s: float = WARM_UP_S) -> None:
    """One throwaway request before the reset, so an idle server's slow first request is not measured (and the
    reset probe has a prompt the server held); its whole answer within `timeout_s`."""
    try:
        probe.complete(server, timeout_s)
    except (urllib.error.URLError, OSError, ValueError):
        pass  # a dead server shows up as failed records, with reasons, in the treatment itself


def reset_and_probe(server: Treatment) -> Reset:
    """Empty a server's tiers, then probe whether they are empty (the warm-up's prompt again). A server whose
    reset failed (one kvscope did not deploy has no /reset_prefix_cache) is not probed: its cache was never
    emptied, and the report says its cache state is not controlled."""
    cleared = reset(server)
    if cleared.reset_prefix_cache_http == 200:
        cleared.probe = probe.reset_probe(server)
    return cleared
