#!/usr/bin/env bash
# On a GPU machine, from the repository root of a scratch copy (the device machine's copy of the
# working tree): apply a pending patch, time its kernels in turn against what it replaces (a probe
# patch that restores the old code), and run the GPU tests it names. The copy is changed in place.
#
#     bash benchmarks/gluon/pending/decide.sh bwd-order
set -euo pipefail
name=$1
out=${OUT:-/tmp}
git apply "benchmarks/gluon/pending/$name.patch"
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
case $name in
  bwd-order)
    probe="benchmarks/gluon/gluon_bwd_probe.py --only document_causal --patches base,index-order"
    shapes=4x16x4096x128,1x16x16384x128,4x32x4096x64,1x32x16384x64
    tests=(tests/test_gpu_gluon.py tests/test_gpu_graphs.py -k "(document and backward) or document_mask") ;;
esac
timeout 300 python $probe --shapes "$shapes" --rounds 3 > "$out/$name-probe.log" 2>&1 || true
timeout 250 python -m pytest -q -x -m gpu "${tests[@]}" > "$out/$name-tests.log" 2>&1 || true
{ grep -A8 "^| variant" "$out/$name-probe.log" || true; } | head -10; tail -n 3 "$out/$name-probe.log" "$out/$name-tests.log"
