"""One system's training step (forward + backward), a few times, for an Nsight Compute profile of
its main backward kernel beside another system's, on a Hopper GPU:

    ncu --clock-control none --kernel-name regex:'^attn_bwd$|BackwardSm90' --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \\
        python benchmarks/gluon/ncu_bwd.py attncc full 4x16x4096x128

(`^attn_bwd$` is the Gluon backward's main kernel, `BackwardSm90` FlashAttention-4's.) The
system is one of bench.py's (attncc, fa4, flex-flash, ...), the variant one of its variants."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench  # noqa: E402
from variants import make_cases  # noqa: E402


def main():
    system, name, shape = sys.argv[1:4]
    B, H, N, D = (int(x) for x in shape.split("x"))
    case = make_cases(H, N, "cuda")[name]
    fn = bench.build(system, case, N)
    torch.manual_seed(0)
    q = torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, H // case.gqa, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    grad = torch.randn_like(q)
    for _ in range(3):
        fn(q, k, v).backward(grad)
    torch.cuda.synchronize()
    print(system, name, shape, "done")


if __name__ == "__main__":
    main()
