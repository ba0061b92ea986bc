# Sourced by the CUDA-host benchmarks that run in parts (PARTS=a,b: those parts, in the script's order).
pick_parts() {  # pick_parts SCRIPT ALL: the parts PARTS names (ALL by default), an unknown one refused; then want PART
  local part names
  parts=,${PARTS:-$2},
  IFS=, read -ra names <<< "${PARTS:-$2}"  # split, never globbed: a name is a part's name or refused
  for part in "${names[@]}"; do
    [[ -z $part || ,$2, == *,"$part",* ]] || { echo "$1: no part '$part' ($2)" >&2; exit 2; }
  done
}
want() { [[ $parts == *,"$1",* ]]; }
