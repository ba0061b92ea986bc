# Sourced by the CUDA-host benchmarks that run in parts (PARTS=a,b: those parts, in the script's order).
pick_parts() {  # pick_parts SCRIPT ALL: the parts PARTS names (ALL by default), an unknown one refused; then want PART
  parts=,${PARTS:-$2},
  for part in ${parts//,/ }; do
    [[ ,$2, == *,$part,* ]] || { echo "$1: no part '$part' ($2)" >&2; exit 2; }
  done
}
want() { [[ $parts == *,$1,* ]]; }
