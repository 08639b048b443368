"""Run a pytest selection on a machine with GPUs in parallel shards, a process per shard, the
shards spread over the GPUs, with a line per shard and the tail of each failing one (the Gluon
GPU tests, which compile a kernel per case, take minutes in one process).

    python benchmarks/gpu_shards.py SHARDS GPUS LOGDIR -- -m gpu tests/test_gpu_gluon.py [-k ...]
"""
import os
import subprocess
import sys
import time


def main():
    shards, gpus, logdir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    args = sys.argv[sys.argv.index("--") + 1:]
    os.makedirs(logdir, exist_ok=True)
    listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", *args], capture_output=True,
                            text=True).stdout
    ids = [line for line in listed.splitlines() if "::" in line]
    print(len(ids), "tests", flush=True)
    start, procs = time.time(), []
    for s in range(min(shards, len(ids))):
        log = open(os.path.join(logdir, f"shard{s}.log"), "w")
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(s % gpus))
        procs.append((s, log, subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                                *ids[s::shards]], stdout=log, stderr=subprocess.STDOUT, env=env)))
    failed = 0
    for s, log, proc in procs:
        proc.wait()
        log.close()
        tail = open(log.name).read().strip().splitlines()
        print(f"shard {s} rc={proc.returncode}: {tail[-1] if tail else ''}", flush=True)
        if proc.returncode:
            failed += 1
            print("\n".join(tail[-40:]))
    print(f"{time.time() - start:.0f} s, {failed} shard(s) failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
