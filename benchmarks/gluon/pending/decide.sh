#!/usr/bin/env bash
# On a GPU machine, from the repository root of a scratch copy (the device machine's copy of the
# working tree): apply a pending patch, time its kernels in turn against the templates it replaces,
# and run the GPU tests it names. The copy is changed in place; the checkout it came from is not.
#
#     bash benchmarks/gluon/pending/decide.sh tile-overlap|lane-banded [probe shapes]
set -euo pipefail
name=$1
shapes=${2:-16x16x1024x128,4x16x4096x128,1x16x16384x128,4x32x4096x64}
out=${OUT:-/tmp}
rm -rf .pending && mkdir -p .pending && cp -r templates .pending/templates
git apply "benchmarks/gluon/pending/$name.patch"
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
case $name in
  tile-overlap)
    only=full,causal,sliding_window_1024,gqa4_causal
    tests="forward" ;;
  lane-banded)  # a plan change: the base kernel is rendered by the plan before it (plan patch mask-kv)
    only=sliding_window_1024
    tests="sliding and forward" ;;
esac
if [ "$name" = lane-banded ]; then patches=base,mask-kv; else patches=base,@.pending/templates; fi
timeout 300 python benchmarks/gluon/gluon_fwd_probe.py --shapes "$shapes" --only "$only" --patches "$patches" \
  --rounds 3 > "$out/$name-probe.log" 2>&1 || true
timeout 280 python -m pytest -q -x -m gpu tests/test_gpu_gluon.py -k "$tests" > "$out/$name-tests.log" 2>&1 || true
{ grep -A12 "^| variant" "$out/$name-probe.log" || true; } | head -14; tail -n 3 "$out/$name-probe.log" "$out/$name-tests.log"
