"""The bench's plan, typed: `kvscope bench --plan`, the Locust spec file, and the command lines' shared helpers."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO


def test_the_plumbing_the_ansible_roles_call_stands_on_no_part_of_the_users_cli():
    probe = "import sys, kvscope.plumbing; print(sorted(m for m in sys.modules if m == 'kvscope.cli'))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr[-2000:]
