"""Store faults at rest: between a store-fault scenario's prime phase (which stores) and its measure phase (which
loads), every file the config's stores hold is damaged one way. A tier must then miss and recompute (its answers
equal golden's) or fail the request; one that loads the damage serves wrong KV, and the scorer FAILs it.

Faults: `bitflip` one bit of a float's exponent in the middle of each file (the size stays); `truncate` each file
cut to half; `swap` each file's name given to the next file's bytes (another prompt's, in a rotation);
`unreadable` each file's mode 000 (permission denied), or, where the bench runs as root (which reads any file),
each file replaced by a link to /proc/self/mem, which is a regular file whose read at offset 0 fails with EIO
(a tier that refuses links fails at the open instead). A slow read needs a FUSE or dm-delay mount: not made.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

from kvscope.artifacts import StoreFaultPhase, Treatment
from kvscope.deploy.folder import DeploymentFolder

FAULTS = ("bitflip", "truncate", "swap", "unreadable")
EIO_FILE = "/proc/self/mem"  # regular, and the reader's own memory at offset 0 is unmapped: read() gives EIO
FLIP = 0x40  # the second-highest bit of a little-endian float's last byte: its exponent (fp32, fp16, bf16)
STABLE_S, SETTLE_S = 0.5, 10.0


def files(server: Treatment) -> list[Path]:
    """The regular files of a config's stores (no links followed), its connector's logs left out; only stores
    inside the deployment's stores folder (as reset() wipes them)."""
    root = DeploymentFolder(Path(server.run_dir).resolve()).stores if server.run_dir else None
    extra = (server.manifest.kv_transfer_config or {}).get("kv_connector_extra_config", {})
    logs = {Path(extra[k]).resolve() for k in ("load_log", "fault_log") if extra.get(k)}
    out = []
    for path in sorted(Path(p).resolve() for p in server.manifest.stores.values()):
        if root is None or path == root or not path.is_relative_to(root):
            continue
        for folder, _, names in os.walk(path):
            for name in names:
                f = Path(folder) / name
                try:
                    if f not in logs and stat.S_ISREG(f.lstat().st_mode):
                        out.append(f)
                except FileNotFoundError:  # evicted meanwhile
                    continue
    return sorted(out)


def settled(server: Treatment) -> list[Path]:
    """The store's files once no save is landing (two listings STABLE_S apart alike), at most SETTLE_S."""
    deadline = time.monotonic() + SETTLE_S
    seen = None
    while True:
        now = [(f, f.stat().st_size) for f in files(server) if f.exists()]
        if now == seen or time.monotonic() > deadline:
            return [f for f, _ in now]
        seen = now
        time.sleep(STABLE_S)


def _bitflip(f: Path) -> None:
    size = f.lstat().st_size
    if not size:
        return
    at = min(size - 1, (size // 2) | 3)  # byte 3 of a 4-byte word: a float's sign and exponent
    fd = os.open(f, os.O_RDWR | os.O_NOFOLLOW)
    try:
        byte = os.pread(fd, 1, at)
        os.pwrite(fd, bytes([byte[0] ^ FLIP]), at)
    finally:
        os.close(fd)


def _swap(found: list[Path]) -> None:
    """Each file's name to the next one's bytes, in a rotation."""
    aside = found[0].with_name(found[0].name + ".kvscope-swap")
    os.replace(found[0], aside)
    for a, b in zip(found, found[1:]):
        os.replace(b, a)
    os.replace(aside, found[-1])


def _unreadable(f: Path, root: bool) -> None:
    if root:
        f.unlink()
        f.symlink_to(EIO_FILE)
    else:
        f.chmod(0)


def damage(server: Treatment, fault: str) -> StoreFaultPhase:
    """Damage every file of a config's stores with one fault; what was done."""
    started = time.monotonic()
    found = settled(server)
    if not found or (fault == "swap" and len(found) < 2):
        return StoreFaultPhase(fault=fault, files=0, how=f"nothing damaged: {len(found)} files in the stores",
                               seconds=round(time.monotonic() - started, 1))
    root = os.geteuid() == 0
    if fault == "swap":
        _swap(found)
    for f in found if fault != "swap" else ():
        if fault == "bitflip":
            _bitflip(f)
        elif fault == "truncate":
            os.truncate(f, f.lstat().st_size // 2)
        elif fault == "unreadable":
            _unreadable(f, root)
    how = {"bitflip": "one exponent bit flipped in the middle of each file (same size)",
           "truncate": "each file cut to half its size",
           "swap": "each file's name given to another file's bytes (a rotation)",
           "unreadable": f"each file replaced by a link to {EIO_FILE} (a read fails with EIO; the bench runs as "
                         "root, which reads a file whatever its mode)" if root else
                         "each file's mode 000 (permission denied)"}[fault]
    return StoreFaultPhase(fault=fault, files=len(found), how=how, seconds=round(time.monotonic() - started, 1))
