#!/usr/bin/env bash
# Run one command on two trees of this project in one device call: a baseline checkout and this one.
#
#   bash scripts/gpu_ab.sh BASELINE_DIR ROUNDS -- COMMAND [ARGS ...]
#
# BASELINE_DIR holds an older tree (e.g. `git archive <commit> ft_transformers kernels patches scripts
# tests pyproject.toml | tar -x -C .baseline`, carried to the device). Each tree is laid out as an
# importable package under /tmp/ab/<tree>/site (kernels/ and patches/ inside ft_transformers/, as
# pyproject.toml's package-dir installs them) and COMMAND runs from that tree's root with
# PYTHONPATH pointing there. The trees alternate for ROUNDS rounds (old, new, old, new, ...), so drift
# of the machine shows up in both. In COMMAND, the literal string @OUT@ becomes
# $OUT/<tree>_<round>, a fresh folder per run.
set -euo pipefail
base=$1; rounds=$2; shift 2
[ "$1" = "--" ] && shift
OUT=${OUT:-gpu_out}
here=$(cd "$(dirname "$0")/.." && pwd)
layout() {  # $1 tree root, $2 site dir
  rm -rf "$2"; mkdir -p "$2"
  cp -r "$1/ft_transformers" "$2/ft_transformers"
  cp -r "$1/kernels" "$2/ft_transformers/kernels"
  cp -r "$1/patches" "$2/ft_transformers/patches"
}
layout "$(cd "$base" && pwd)" /tmp/ab/old/site
layout "$here" /tmp/ab/new/site
for r in $(seq 1 "$rounds"); do
  for tree in old new; do
    root=$([ $tree = old ] && (cd "$base" && pwd) || echo "$here")
    dir="$OUT/${tree}_$r"; mkdir -p "$dir"
    echo "=== $tree round $r ($(date +%H:%M:%S))"
    args=("${@//@OUT@/$dir}")
    (cd "$root" && PYTHONPATH=/tmp/ab/$tree/site "${args[@]}") || echo "!!! $tree round $r exited $?"
  done
done
