#!/usr/bin/env bash
# Context parallelism on a machine with several GPUs (issue 35), in two device calls of < 10 minutes:
#
#   bash benchmarks/cp_multi_gpu.sh tests   # NCCL correctness: every CPU-list variant, bf16 and fp16,
#                                           # both layouts, ring and all-gather, forward and backward
#   bash benchmarks/cp_multi_gpu.sh bench   # scaling on 1, 2, 4, 8 ranks (as many as there are GPUs),
#                                           # and the sliding window over the contiguous layout at 128k
#   bash benchmarks/cp_multi_gpu.sh bench 131072 524288   # only these whole lengths (to split the
#                                           # grid over calls when one would run past its limit)
#
# Results go to $OUT (the device machine's return folder) or ./cp-out: cp.json holds one entry per
# (ranks, shape) run, for benchmarks/results/<gpu>-cp.json; cp-{ring,allgather}-W*-L{32768,131072}.json,
# chrome traces of the causal forward+backward (how much of NCCL's time runs under the attention
# kernels, where rank 0's GPU time goes). NCCL's settings stay as the machine has them (NVLink
# multicast off: NCCL_NVLS_ENABLE=0).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-cp-out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee "$out/gpus.txt"

case "${1:-}" in
tests)
    python -m pytest -m gpu -q -s -rf tests/test_gpu_distributed.py -k nccl 2>&1 | tee "$out/nccl-tests.log"
    ;;
bench)
    # shape: whole length, query heads, K/V heads, iterations; the one-device run only where it fits
    # in the time (512k: a forward and backward of one device take seconds)
    for shape in "32768 16 16 10" "131072 16 16 5" "131072 16 2 5" "524288 16 16 2"; do
        read -r L H HKV ITERS <<<"$shape"
        [ $# -le 1 ] || [[ " ${*:2} " == *" $L "* ]] || continue
        single=$([ "$L" -le 131072 ] || echo --no-single)
        prof=$([ "$L" -le 131072 ] && [ "$HKV" = "$H" ] && echo --profile "$out")  # a trace per length and group size
        for n in 1 2 4 8; do
            [ "$n" -le "$gpus" ] || continue
            [ "$L" -gt 131072 ] && [ "$n" -lt "$gpus" ] && continue  # 512k: only the largest group
            torchrun --nproc-per-node "$n" benchmarks/context_parallel.py --seq "$L" --heads "$H" \
                --kv-heads "$HKV" --iters "$ITERS" --warmup 2 $single $prof --json "$out/cp.json" \
                2>&1 | grep -v "^W1\|OMP_NUM_THREADS" | tee -a "$out/cp-bench.log"
        done
    done
    # a one-sided window over the contiguous layout: the ring stops after two steps (ring_steps)
    if [ $# -le 1 ] || [[ " ${*:2} " == *" 131072 "* ]]; then
        torchrun --nproc-per-node "$gpus" benchmarks/context_parallel.py --seq 131072 --layout contiguous \
            --variants sliding_window --iters 5 --warmup 2 --no-torch-cp --json "$out/cp.json" \
            2>&1 | grep -v "^W1\|OMP_NUM_THREADS" | tee -a "$out/cp-bench.log"
    fi
    ;;
*)
    echo "usage: bash benchmarks/cp_multi_gpu.sh tests|bench" >&2
    exit 2
    ;;
esac
