#!/usr/bin/env bash
# The Python sources of every vLLM a CUDA host may serve (wheels.txt's and each stack's pin), one folder each
# under OUT/<version>: check_server_args.py --on-cpu parses rendered flags with each release's own parser on a
# machine without a GPU (the compiled parts are left out: ~35 MB a release instead of ~750).
#   docker/parser-vllms.sh OUT
set -euo pipefail
out=$1; here=$(cd "$(dirname "$0")" && pwd)
plat=(--python-version 3.12 --implementation cp --only-binary=:all: --platform manylinux_2_28_x86_64)
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
for pin in $(grep -h '^vllm==' "$here/offline-wheels/wheels.txt" "$here"/offline-wheels/stacks/*.txt | sort -u); do
  version=${pin#vllm==}
  [ -f "$out/$version/vllm/__init__.py" ] && continue
  python3 -m pip download -q --no-deps "${plat[@]}" -d "$work" "$pin"
  rm -rf "$out/$version.part" && mkdir -p "$out/$version.part"
  unzip -q "$work"/vllm-"$version"-*.whl 'vllm/*.py' "vllm-$version.dist-info/*" -d "$out/$version.part"
  rm -rf "$out/$version" && mv "$out/$version.part" "$out/$version" && rm -f "$work"/*.whl
  echo "vLLM $version's sources in $out/$version"
done
