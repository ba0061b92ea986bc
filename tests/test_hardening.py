"""What a stale pid file, a hostile manifest or a broken input does to the harness (no servers)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from kvscope.deploy import servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_stale_pid_file_never_signals_the_process_that_now_has_its_pid(tmp_path):
    pid_file = tmp_path / "server.pid"
    lookalike = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", servers.SERVER_COMMAND])
    try:
        pid_file.write_text(f"{lookalike.pid}\n")  # an older kvscope's pid file: the pid alone
        assert servers.started(pid_file) == lookalike.pid
        os.utime(pid_file, (0, 0))  # written before this process started: its pid was given to someone else
        assert servers.started(pid_file) is None
    finally:
        lookalike.kill()
        lookalike.wait()
    bystander = subprocess.Popen(["setsid", "sleep", "120"])  # a session leader, as a server would be
    pid, port = bystander.pid, free_port()
    start = servers.stamp(pid).split()[1]
    try:
        for stale in (f"{pid}", f"{pid} 1 {servers.boot_id()}", f"{pid} {start} another-boot",
                      servers.stamp(pid)):  # the last: this very process, but not a vLLM server
            pid_file.write_text(stale)
            assert "not signalled" in servers.stop(pid_file, grace_s=1), stale
            assert servers.alive(pid) and not pid_file.exists()
        for stale in (f"{pid}", f"{pid} 1 {servers.boot_id()}"):
            pid_file.write_text(stale)
            assert servers.probe(pid_file, port)[0] == servers.NOT_RUNNING
        pid_file.write_text(servers.stamp(pid))
        assert servers.started(pid_file) == pid
    finally:
        bystander.kill()
        bystander.wait()
