# Sourced by wheelhouse.sh and build.sh: the image's pins, its target platforms, and no say for this host's pip
# configuration (mirrors, constraints).
# shellcheck shell=bash
export PIP_CONFIG_FILE=/dev/null
pin() { awk -v k="$1:" '/^gb10-pypi:/{f=1} f && $1==k {print $2; exit}' "$(dirname "${BASH_SOURCE[0]}")/../versions.yaml"; }
platforms=()
for tag in manylinux_2_{41..17} manylinux2014 linux; do  # trixie's glibc is 2.41
  platforms+=(--platform "${tag}_aarch64")
done
