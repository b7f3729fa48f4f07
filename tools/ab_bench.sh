#!/usr/bin/env bash
# A/B a change on a GPU machine: copies of this tree, each with its patches applied, take turns running one
# benchmark command, round after round, each in a process of its own; every output line is prefixed with
# the variant and round. Taking turns spreads the GPU's drift (clocks, temperature) over the variants alike.
#   bash tools/ab_bench.sh [-r ROUNDS] [-g REGEX] "COMMAND" VARIANT...
#   VARIANT: NAME (this tree as it is), NAME=P1,P2 (with patches P1 then P2 applied) or NAME=-P (with P
#   reversed: this tree without a change it holds uncommitted). -g keeps only the lines matching REGEX.
# For example, a change in the working tree against the tree without it:
#   git diff > .session/x.patch
#   bash tools/ab_bench.sh -r 2 -g '^qwen' "python3 tools/bench_decode.py --section token --samples 3" \
#     main=-.session/x.patch new
# Output: $OUT/ab.log (the device tool's output folder) or ./gpu_out/ab.log; the copies are $AB_DIR/NAME
# (default /tmp/ab); they share CuPy's compiled modules wherever their sources agree (the include path is a
# directory named by the headers' digest: _build._header_dir). Exits 1 when a patch does not apply; a command
# that fails is reported on stderr.
set -uo pipefail
cd "$(dirname "$0")/.."
rounds=2 keep=.
while getopts "r:g:" opt; do
  case $opt in
    r) rounds=$OPTARG ;;
    g) keep=$OPTARG ;;
    *) echo "usage: $0 [-r ROUNDS] [-g REGEX] COMMAND VARIANT..." >&2; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
[ $# -ge 2 ] || { echo "usage: $0 [-r ROUNDS] [-g REGEX] COMMAND VARIANT..." >&2; exit 2; }
command=$1
shift
out=${OUT:-gpu_out}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null ||
    echo "ab_bench: the carried wheels did not install into /tmp/site" >&2
fi
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
src=$PWD
copies=${AB_DIR:-/tmp/ab}
names=()
for variant in "$@"; do
  name=${variant%%=*}
  dir=$copies/$name
  rm -rf "$dir" && mkdir -p "$dir"
  tar cf - --exclude=.whl --exclude=.git --exclude=.venv --exclude=gpu_out . | (cd "$dir" && tar xf -)
  if [ "$name" != "$variant" ]; then
    IFS=, read -ra patches <<< "${variant#*=}"
    for p in "${patches[@]}"; do
      reverse=()
      if [ "${p#-}" != "$p" ]; then reverse=(-R); p=${p#-}; fi
      [ "${p#/}" != "$p" ] || p=$src/$p
      (cd "$dir" && git apply "${reverse[@]}" "$p") || { echo "ab_bench: $p does not apply to $name" >&2; exit 1; }
    done
  fi
  names+=("$name")
done
for ((round = 1; round <= rounds; round++)); do
  for name in "${names[@]}"; do
    (cd "$copies/$name" && PYTHONPATH=/tmp/site:$PWD bash -c "$command" 2>&1
     rc=$?; [ $rc = 0 ] || echo "ab_bench: the command exited $rc in $name, round $round" >&2) |
      grep -E -- "$keep" | sed "s/^/$name r$round  /"
  done
done | tee "$out/ab.log"
exit 0
