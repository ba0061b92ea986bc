"""Build-time check of a kvscope GPU image: every connector imports, every kernel library runs on the GPU.

What counts as code that runs on compute capability 12.1 (GB10), per CUDA's compatibility rules:
- SASS for sm_121 or sm_121a (native);
- SASS for plain sm_120: a cubin runs on the same major version with an equal or higher minor. Not
  sm_120a or sm_120f: arch-specific cubins run only on their exact target;
- PTX for compute_XY with XY <= 121, which the driver JIT-compiles at first load (slow start, accepted
  as a fallback and reported).
A library with device code but none of these fails the check (unless it is built for one other GPU
generation on purpose, ARCH_SPECIFIC, such as FlashAttention 3 for Hopper), as does a package without any
library holding device code, or a module that does not import. The table printed at the end lists every library
inspected, with its SASS and PTX targets.

    python3 verify_image.py --arch 121 [--cuobjdump PATH] [--without ucm=/opt/kvscope/ucm-cp312]

--without PACKAGE=DIR: the package is not installed (its imports are reported as skipped) and its
libraries are inspected in DIR, an unpacked wheel.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

MODULES = {
    "vllm": ["vllm"],
    "ucm": ["ucm.integration.vllm.ucm_connector", "ucm.integration.vllm.blend_connector"],
    "lmcache": ["lmcache.integration.vllm.vllm_v1_adapter", "lmcache.integration.vllm.lmcache_mp_connector"],
    "kvscope_connector": ["kvscope_connector", "kvscope_connector.canary"],
}
# The libraries whose kernels serve a request, per package (globs under the package's folder).
KERNEL_LIBS = {"torch": ["lib/libtorch_cuda.so"], "vllm": ["_C*.so", "_moe_C*.so", "vllm_flash_attn/*.so"],
               "lmcache": ["c_ops*.so", "cuda_ops*.so"], "ucm": ["**/*.so"]}
# Libraries built for one GPU generation on purpose, which vLLM selects only there: reported, never a failure.
ARCH_SPECIFIC = {"_vllm_fa3_C": "FlashAttention 3: Hopper (sm_90a) only; vLLM does not select it elsewhere"}
_TARGET = re.compile(r"sm_(\d+)([af]?)\b")


def targets(listing: str) -> set[tuple[int, str]]:
    """(arch number, suffix) pairs named in a `cuobjdump --list-elf` or `--list-ptx` listing."""
    return {(int(m.group(1)), m.group(2)) for m in _TARGET.finditer(listing)}


def verdict(elf: set[tuple[int, str]], ptx: set[tuple[int, str]], arch: int) -> str | None:
    """How a library runs on `arch` ("native", "compatible sm_120", "PTX JIT"), or None if it cannot."""
    major = arch // 10
    if any(a == arch for a, _ in elf):
        return "native"
    compatible = [a for a, suffix in elf if a // 10 == major and a < arch and suffix == ""]
    if compatible:
        return f"compatible sm_{max(compatible)}"
    jit = [a for a, _ in ptx if a <= arch]
    if jit:
        return f"PTX JIT from compute_{max(jit)}"
    return None


def _names(found: set[tuple[int, str]]) -> str:
    return " ".join(f"{a}{s}" for a, s in sorted(found)) or "-"


def inspect(cuobjdump: str, libs: list[Path], arch: int) -> tuple[list[str], list[str]]:
    """Table rows for the libraries holding device code, and the failures among them."""
    rows, failures = [], []
    for lib in libs:
        elf = targets(subprocess.run([cuobjdump, "--list-elf", str(lib)], capture_output=True, text=True).stdout)
        ptx = targets(subprocess.run([cuobjdump, "--list-ptx", str(lib)], capture_output=True, text=True).stdout)
        if not elf and not ptx:
            continue  # host code only
        how = verdict(elf, ptx, arch)
        why_not = next((why for prefix, why in ARCH_SPECIFIC.items() if lib.name.startswith(prefix)), None)
        cell = how or (f"none ({why_not})" if why_not else "**none: cannot run**")
        rows.append(f"| `{lib.name}` | {_names(elf)} | {_names(ptx)} | {cell} |")
        if how is None and why_not is None:
            failures.append(f"{lib}: no code for sm_{arch} (SASS {_names(elf)}, PTX {_names(ptx)})")
    return rows, failures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=121, help="compute capability without the dot (GB10: 121)")
    ap.add_argument("--cuobjdump", default=shutil.which("cuobjdump") or "/usr/local/cuda/bin/cuobjdump")
    ap.add_argument("--without", action="append", default=[], metavar="PACKAGE=DIR",
                    help="a package that is not installed; its libraries are inspected in DIR (an unpacked wheel)")
    args = ap.parse_args()
    without = dict(item.split("=", 1) for item in args.without)
    failures = []
    for package, modules in MODULES.items():
        for name in modules:
            if package in without:
                print(f"import {name}: skipped ({package} is not installed; libraries from {without[package]})")
                continue
            try:
                importlib.import_module(name)
                print(f"import {name}: ok")
            except Exception as exc:  # any import failure is a broken image
                failures.append(f"import {name}: {type(exc).__name__}: {exc}")
    if not Path(args.cuobjdump).exists():
        failures.append(f"cuobjdump not found at {args.cuobjdump}: cannot check kernels for sm_{args.arch}")
    else:
        table = [f"| library | SASS (sm_) | PTX (compute_) | on sm_{args.arch} |", "|---|---|---|---|"]
        for package, patterns in KERNEL_LIBS.items():
            if package in without:
                root: Path | None = Path(without[package]) / package
            else:
                spec = importlib.util.find_spec(package)
                root = Path(spec.origin).parent if spec and spec.origin else None
            libs = sorted({p for pattern in patterns for p in (root.glob(pattern) if root else [])})
            rows, failed = inspect(args.cuobjdump, libs, args.arch)
            table += rows
            failures += failed
            if not rows:
                failures.append(f"{package}: no library with device code ({', '.join(patterns)}) under {root}")
        print("\n".join(table))
    for failure in failures:
        print(f"FAIL {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
