"""Build-time check of a kvscope GPU image: every connector imports, every kernel library runs on the GPU.

What counts as code that runs on compute capability 12.1 (GB10), per CUDA's compatibility rules:
- SASS for sm_121 or sm_121a (native);
- SASS for plain sm_120: a cubin runs on the same major version with an equal or higher minor. Not
  sm_120a or sm_120f: arch-specific cubins run only on their exact target;
- PTX for compute_XY with XY <= 121, which the driver JIT-compiles at first load (slow start, accepted
  as a fallback and reported).
A kernel library with none of these fails the build, as does a module that does not import.

    python3 verify_image.py --arch 121 [--cuobjdump /usr/local/cuda/bin/cuobjdump]
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

MODULES = [
    "vllm",
    "ucm.integration.vllm.ucm_connector",
    "ucm.integration.vllm.blend_connector",
    "lmcache.integration.vllm.vllm_v1_adapter",
    "kvscope_connector",
    "kvscope_connector.canary",
]
KERNEL_LIBS = {"vllm": ["_C*.so", "_moe_C*.so"], "lmcache": ["c_ops*.so"]}
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=121, help="compute capability without the dot (GB10: 121)")
    ap.add_argument("--cuobjdump", default=shutil.which("cuobjdump") or "/usr/local/cuda/bin/cuobjdump")
    args = ap.parse_args()
    failures = []
    for name in MODULES:
        try:
            importlib.import_module(name)
            print(f"import {name}: ok")
        except Exception as exc:  # any import failure is a broken image
            failures.append(f"import {name}: {type(exc).__name__}: {exc}")
    if not Path(args.cuobjdump).exists():
        failures.append(f"cuobjdump not found at {args.cuobjdump}: cannot check kernels for sm_{args.arch}")
    else:
        for package, patterns in KERNEL_LIBS.items():
            root = Path(importlib.util.find_spec(package).origin).parent if importlib.util.find_spec(package) else None
            libs = [p for pattern in patterns for p in (root.glob(pattern) if root else [])]
            if not libs:
                failures.append(f"{package}: no compiled kernel library ({', '.join(patterns)}) found")
            for lib in libs:
                elf = subprocess.run([args.cuobjdump, "--list-elf", str(lib)], capture_output=True, text=True).stdout
                ptx = subprocess.run([args.cuobjdump, "--list-ptx", str(lib)], capture_output=True, text=True).stdout
                how = verdict(targets(elf), targets(ptx), args.arch)
                if how is None:
                    found = sorted(f"sm_{a}{s}" for a, s in targets(elf) | targets(ptx))
                    failures.append(f"{lib}: no code for sm_{args.arch} (has {found or 'nothing'})")
                else:
                    print(f"{lib.name}: {how}")
    for failure in failures:
        print(f"FAIL {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
