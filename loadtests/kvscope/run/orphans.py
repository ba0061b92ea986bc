"""Locust processes that outlive their bench: none should, and none may write into a resumed run.

A bench killed with kill -9 (or by the OOM killer) runs no cleanup: its Locust is killed by the kernel instead
(PR_SET_PDEATHSIG, set in the child before it runs Locust), and so is each worker process Locust forks. A resume
still refuses to start while any process writes records into its folder (an older kvscope's Locust, another
bench resuming the same run): their records would be mixed with its own.
"""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Callable
from pathlib import Path

from kvscope.run.locustspec import FLAG

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# The Locust options naming a file of a run folder: the spec (which names the records file a process appends to),
# and an older kvscope's records file
FLAGS = (FLAG, "--kvscope-records")
_prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the forked child only calls it


def die_with_parent(parent: int) -> None:
    """Have the kernel kill this process when its parent (pid `parent`) ends; end now if it already has."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def dies_with_me() -> Callable[[], None]:
    """A subprocess preexec_fn: the child dies with this process, whatever ends it."""
    parent = os.getpid()
    return lambda: die_with_parent(parent)


def writers(run_folder: Path) -> list[int]:
    """The pids of the processes (other than this one) whose command line runs Locust on a file of `run_folder`
    (its spec, or an older kvscope's records file): they append records into it."""
    inside = str(Path(run_folder).resolve()) + os.sep
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            args = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:  # gone meanwhile
            continue
        if any(a in FLAGS and b.startswith(inside) for a, b in zip(args, args[1:])):
            found.append(int(proc.name))
    return sorted(found)
