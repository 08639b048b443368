"""One variant's rendered Gluon kernel compiled for sm90 on a machine without a GPU: its resource
usage (registers, stack) and the instruction counts of each loop of its SASS, the figures the
notes quote (masked / unmasked key steps, spills inside loops).

    ATTNCC_TRITON_36=DIR python benchmarks/gluon/sass.py fwd causal 128 [--group 4] [--dtype float16]
        [--cp] [--learn] [--sass FILE] [--ptx FILE] [--patch NAME] [--templates DIR]

KIND is fwd or bwd; NAME one of tests/variants.py's variants (causal, document, alibi, ...) or
test_gluon_tier's extra ones (trig, row_biases); --cp renders the chunk kernels (Q_OFF, KV_OFF);
--patch applies a probe patch (bwd_patches.py / fwd_patches.py, or a plan patch of probe_common.py;
names joined by +) before compiling.
The compile is tests/test_gluon_tier.py's (the CI test), run with the Triton in ATTNCC_TRITON_36
(the GPU machines' 3.6; without it, this environment's). A loop is the span from a label to a
branch back to it (not the retry blocks of mbarrier waits), so nested loops are listed inside
their outer ones.
"""
import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

DUMP = """
import subprocess as _sp
from pathlib import Path as _P
_bin = _P(triton.__file__).parent / "backends" / "nvidia" / "bin"
_cubin = _P(path).with_suffix(".cubin")
_cubin.write_bytes(compiled.asm["cubin"])
print("usage", _sp.run([str(_bin / "cuobjdump"), "--dump-resource-usage", str(_cubin)], capture_output=True,
                       text=True).stdout.strip().splitlines()[-1].strip())
_P(path).with_suffix(".ptx").write_text(compiled.asm["ptx"])
_P(path).with_suffix(".sass").write_text(_sp.run([str(_bin / "nvdisasm"), "-c", str(_cubin)], capture_output=True,
                                                text=True).stdout)
"""


def loops(sass: str):
    """(first address, last address, opcode counts) of every backward branch's span."""
    ins, labels = [], {}
    lines = sass.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2)))
        label = re.match(r"\.(L_x_\d+):", line.strip())
        if label:
            nxt = next((re.match(r"\s*/\*([0-9a-f]{4,})\*/", x) for x in lines[i + 1:] if re.match(r"\s*/\*", x)), None)
            if nxt:
                labels[label.group(1)] = int(nxt.group(1), 16)
    for i, (addr, text) in enumerate(ins):
        m = re.search(r"BRA\s+`?\(?\.?(L_x_\d+)", text)
        # ptxas puts an mbarrier wait's retry at the function's end, whence it branches back: not a loop
        retry = any("SYNCS.PHASECHK" in t for _, t in ins[max(0, i - 3):i])
        if m and labels.get(m.group(1), addr) < addr and not retry:
            lo = labels[m.group(1)]
            body = [re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for a, t in ins if lo <= a <= addr]
            yield lo, addr, collections.Counter(body)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("kind", choices=("fwd", "bwd"))
    p.add_argument("name")
    p.add_argument("head_dim", type=int)
    p.add_argument("--group", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--cp", action="store_true", help="the chunk kernels of context parallelism")
    p.add_argument("--split", action="store_true", help="bwd, GQA: a program per query head (float32 dK, dV sums)")
    p.add_argument("--learn", action="store_true", help="bwd: every captured tensor learnable (its gradient's atomics)")
    p.add_argument("--no-fold", action="store_true", help="bwd: FOLD_LSE off (lse2 read in the step, as for a scale of 0)")
    p.add_argument("--sass", help="also write the SASS here")
    p.add_argument("--ptx", help="also write the PTX here")
    p.add_argument("--patch", default="", help="a probe patch of the rendered source (timing probes' tables)")
    p.add_argument("--templates", help="render from this templates/ folder (another commit's: git archive)")
    args = p.parse_args()
    from attncc import codegen, runtime
    from attncc.spec import Spec
    runtime._triton(for_cpu=True)
    from test_gluon_tier import COMPILE, _variant
    variant = _variant(args.name, H=2 * args.group)
    learnable = tuple(range(len(variant.captures))) if args.learn else ()
    spec = Spec(args.dtype, args.head_dim, args.head_dim, args.group, "cuda-sm90", tier="gluon", offsets=args.cp,
                learnable=learnable)
    kind = args.kind + ("-cp" if args.cp else "-split" if args.split else "-learn" if args.learn else
                        "-nofold" if args.no_fold else "")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{args.kind}_{args.name}.py"
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from probe_common import apply, build_plan
        kernel_plan = build_plan(args.kind, variant, spec, args.patch)
        source = codegen.render(kernel_plan, args.templates)
        if args.patch:
            source = apply(source, args.patch, __import__(f"{args.kind}_patches").PATCHES)
        path.write_text(source)
        env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "ATTNCC_INTERPRET")}
        env["TRITON_CACHE_DIR"] = str(Path(tmp) / "cache")
        if os.environ.get("ATTNCC_TRITON_36"):
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.environ["ATTNCC_TRITON_36"], env.get("PYTHONPATH")]))
        shapes = [list(c.tensor.shape) for c in variant.captures]
        out = subprocess.run([sys.executable, "-c", COMPILE + DUMP, str(path), str(args.head_dim), str(args.group),
                              args.dtype, json.dumps(shapes), kind], capture_output=True, text=True, env=env)
        if out.returncode:
            sys.exit(out.stderr[-20000:])
        print(next(line for line in out.stdout.splitlines() if line.startswith("compiled")))
        print(next(line for line in out.stdout.splitlines() if line.startswith("usage")))
        sass = path.with_suffix(".sass").read_text()
        if args.ptx:
            Path(args.ptx).write_text(path.with_suffix(".ptx").read_text())
    if args.sass:
        Path(args.sass).write_text(sass)
    print(f"{'loop':>17} {'instructions':>12} {'HGMMA':>5} {'MUFU.EX2':>8} {'STL':>4} {'LDL':>4} {'LDG':>4}")
    for lo, hi, ops in loops(sass):
        count = lambda prefix: sum(n for op, n in ops.items() if op.startswith(prefix))  # noqa: E731
        if count("HGMMA"):  # the loops that run products: key or query steps and the tile loops around them
            print(f"{lo:#7x}-{hi:#7x} {sum(ops.values()):>12} {count('HGMMA'):>5} {count('MUFU.EX2'):>8} "
                  f"{count('STL'):>4} {count('LDL'):>4} {count('LDG'):>4}")


if __name__ == "__main__":
    main()
