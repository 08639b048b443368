"""Where a kernel's warps stall, per loop and per instruction, from Nsight Compute's source page:

    ncu --clock-control none --kernel-name regex:'^attn_bwd$' --launch-skip 1 --launch-count 1 \\
        --section SourceCounters --section WarpStateStats --import-source yes -o bwd \\
        python benchmarks/gluon/ncu_bwd.py attncc full 4x16x4096x128
    ncu --import bwd.ncu-rep --page source --csv --print-source sass > bwd.csv
    python benchmarks/gluon/ncu_stalls.py bwd.csv [--walk 2] [--min 0.4]

Prints each executed loop's share of the stall samples with its leading reasons, then walks the
`--walk`-th hottest loop instruction by instruction (those above `--min` % of its samples, and every
HGMMA, wait, barrier and fence). Loops are the backward branches over more than 2 KB of code and
less than a quarter of it, each instruction counted in the innermost; the rest of the kernel is
"other" (for attncc's Gluon kernels mostly the warps that pad the producer's partition, waiting at
the kernel's end)."""
import argparse
import collections
import csv
import re

KEEP = ("HGMMA", "DEPBAR", "SYNCS", "BAR.SYNC", "MEMBAR", "FENCE")


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("csv")
    parser.add_argument("--walk", type=int, default=1, help="walk the n-th hottest loop (1: the hottest)")
    parser.add_argument("--min", type=float, default=0.4, help="walk: instructions above this % of the loop")
    args = parser.parse_args()
    rows = list(csv.reader(open(args.csv)))
    header = next(r for r in rows if "Address" in r)
    data = rows[rows.index(header) + 1:]
    col = {h: i for i, h in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    base = int(data[0][col["Address"]], 16)
    at = [int(r[col["Address"]], 16) - base for r in data]
    loops = []
    for i, (a, r) in enumerate(zip(at, data)):
        branch = re.search(r"BRA (0x[0-9a-f]+)", r[col["Source"]])
        retry = any("PHASECHK" in data[j][col["Source"]] for j in range(max(i - 2, 0), i))  # a wait's retry loop
        if branch and not retry and number(r[col["Instructions Executed"]]) > 0:
            target = int(branch.group(1), 16) - base
            if 0 <= target < a and 0x800 < a - target < at[-1] // 4:  # not the partitions' outer loops
                loops.append((target, a))
    stalls = collections.defaultdict(collections.Counter)
    for a, r in zip(at, data):
        inside = [(hi - lo, lo, hi) for lo, hi in loops if lo <= a <= hi]
        region = "loop {1:#x}-{2:#x}".format(*min(inside)) if inside else "other"  # the innermost
        for h in reasons:
            stalls[region][h[len("stall_"):]] += number(r[col[h]])
    total = sum(sum(c.values()) for c in stalls.values())
    ranked = sorted(stalls.items(), key=lambda item: -sum(item[1].values()))
    for region, counts in ranked:
        share = sum(counts.values()) or 1
        print(f"{region:22s} {100 * share / total:5.1f} %   "
              + "  ".join(f"{k} {100 * v / share:.0f} %" for k, v in counts.most_common(5)))
    loop_names = [region for region, _ in ranked if region != "other"]
    if len(loop_names) < args.walk:
        return
    name = loop_names[args.walk - 1]
    lo, hi = (int(x, 16) for x in name.split()[1].split("-"))
    share = sum(stalls[name].values()) or 1
    print(f"\n{name}, instructions by their share of its stall samples:")
    for a, r in zip(at, data):
        if not lo <= a <= hi:
            continue
        samples = number(r[col["Warp Stall Sampling (All Samples)"]])
        source = r[col["Source"]].strip()
        if 100 * samples / share >= args.min or any(k in source for k in KEEP):
            top = sorted(((number(r[col[h]]), h[len("stall_"):]) for h in reasons), reverse=True)[:2]
            print(f"{a:#07x} {100 * samples / share:5.1f} %  {source[:64]:64s} "
                  + " ".join(f"{why} {n:.0f}" for n, why in top if n))


if __name__ == "__main__":
    main()
