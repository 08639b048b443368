"""What benchmarks/bench.py prints and writes: speedup columns, markdown tables, the results JSON
(merged with an existing file row by row) and the speedup chart."""
from __future__ import annotations

import json
from pathlib import Path


def row_key(r):
    """Rows of a later run replace rows of the same key in the results file."""
    return (r["kind"], r["system"], r["variant"], r["B"], r["H"], r["N"], r["D"])


# The strongest peers per cell (issue targets): the fastest of these that runs it; where none does,
# FlexAttention's Triton backend; dropout (which none of them has): SDPA's flash backend.
STRONGEST = ("flex-flash", "fa4", "sdpa-cudnn")
FALLBACK = ("flex", "sdpa-flash")


def add_speedups(rows):
    """attncc timing rows get flex_ms / attncc_ms, best-SDPA ms / attncc_ms and best-peer ms /
    attncc_ms (STRONGEST), for fwd, bwd and fwd+bwd (> 1: attncc is faster); sdpa_best_* and
    peer_best_* name the system compared with."""
    shape = lambda r: (r["variant"], r["B"], r["H"], r["N"], r["D"])  # noqa: E731
    timing = [r for r in rows if r["kind"] == "timing"]
    for a in (r for r in timing if r["system"] == "attncc"):
        same = [r for r in timing if shape(r) == shape(a)]
        for part in ("fwd", "bwd", "fwdbwd"):
            ms = f"{part}_ms"
            flex = next((r[ms] for r in same if r["system"] == "flex" and r[ms] is not None), None)
            best = min((r for r in same if r["system"].startswith("sdpa") and r[ms] is not None),
                       key=lambda r: r[ms], default=None)
            ok = a[ms] is not None and a[ms] > 0
            a[f"speedup_vs_flex_{part}"] = flex / a[ms] if ok and flex and flex > 0 else None
            a[f"speedup_vs_sdpa_{part}"] = best[ms] / a[ms] if ok and best and best[ms] > 0 else None
            a[f"sdpa_best_{part}"] = best["system"] if ok and best else None
            ran = lambda systems: [r for r in same if r["system"] in systems and r[ms] and r[ms] > 0]  # noqa: E731
            peer = min(ran(STRONGEST) or ran(FALLBACK[:1]) or ran(FALLBACK[1:]), key=lambda r: r[ms], default=None)
            a[f"speedup_vs_peer_{part}"] = peer[ms] / a[ms] if ok and peer else None
            a[f"peer_best_{part}"] = peer["system"] if ok and peer else None


def save(rows, env, path: Path):
    """Write rows (each carrying env: GPU, versions, date) to path, keeping the rows of an earlier
    run whose key this run did not measure. Returns every row now in the file."""
    new = [dict(r, **env) for r in rows]
    keys = {row_key(r) for r in new}
    old = json.loads(path.read_text()) if path.exists() else []
    merged = [r for r in old if row_key(r) not in keys] + new
    add_speedups(merged)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(merged, indent=1) + "\n")
    return merged


# ---------------------------------------------------------------- text

def fmt(x, spec):
    return "n/a" if x is None else format(x, spec)


def fmt_shape(s):
    return "x".join(map(str, s))


def row_shape(r):
    return f"{r['B']}×{r['H']}×{r['N']}×{r['D']}"


def progress_line(r):
    errs = r.get("check_errors") or {}
    worst = max((e for e in errs.values() if isinstance(e, float)), default=None)
    checked = f"check vs {r['check_ref']}: max rel err {worst:.1e}  " if r.get("check_ok") else ""
    return (f"{r['system']:10s} {r['variant']:22s} {row_shape(r):16s} fwd {fmt(r['fwd_ms'], '.3f')} ms "
            f"({fmt(r['fwd_tflops'], '.0f')} TFLOP/s)  bwd {fmt(r['bwd_ms'], '.3f')} ms "
            f"({fmt(r['bwd_tflops'], '.0f')} TFLOP/s)  {checked}{r['note'] or ''}")


def ratio_cell(r, vs):
    cells = [r.get(f"speedup_vs_{vs}_{p}") for p in ("fwd", "bwd")]
    return "" if all(c is None for c in cells) else " · ".join(fmt(c, ".2f") + "×" for c in cells)


def timing_table(rows):
    lines = ["| variant | B×H×N×D | system | fwd ms | bwd ms | fwd TFLOP/s | bwd TFLOP/s | attncc/flex fwd · bwd "
             "| attncc/best SDPA fwd · bwd | attncc/best peer fwd · bwd (peer) | note |",
             "|---|---|---|--:|--:|--:|--:|--:|--:|--:|---|"]
    for r in rows:
        peers = "/".join(dict.fromkeys(p for p in (r.get("peer_best_fwd"), r.get("peer_best_bwd")) if p))
        lines.append(f"| {r['variant']} | {row_shape(r)} | {r['system']} | {fmt(r['fwd_ms'], '.3f')} | "
                     f"{fmt(r['bwd_ms'], '.3f')} | {fmt(r['fwd_tflops'], '.0f')} | {fmt(r['bwd_tflops'], '.0f')} | "
                     f"{ratio_cell(r, 'flex')} | {ratio_cell(r, 'sdpa')} | "
                     f"{ratio_cell(r, 'peer')}{f' ({peers})' if peers else ''} | {r['note'] or ''} |")
    return "\n".join(lines)


def latency_table(rows):
    by = {(r["variant"], r["system"]): r for r in rows}
    lines = ["| variant | B×H×N×D | attncc cold s | attncc warm s | flex cold s | flex warm s | note |",
             "|---|---|--:|--:|--:|--:|---|"]
    for name in dict.fromkeys(r["variant"] for r in rows):
        a, f = by.get((name, "attncc"), {}), by.get((name, "flex"), {})
        note = "; ".join(f"{s}: {r['note']}" for s, r in (("attncc", a), ("flex", f)) if r.get("note"))
        lines.append(f"| {name} | {row_shape(a or f)} | {fmt(a.get('cold_s'), '.2f')} | "
                     f"{fmt(a.get('warm_s'), '.2f')} | {fmt(f.get('cold_s'), '.2f')} | {fmt(f.get('warm_s'), '.2f')} "
                     f"| {note} |")
    return "\n".join(lines)


# ---------------------------------------------------------------- chart

def plot(rows, path: Path):
    """Grouped bars, one panel per shape: attncc's forward and backward speed relative to the
    fastest peer that ran the cell (add_speedups' peer_best_*; > 1: attncc is faster)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        print(f"matplotlib is not installed: no chart ({path.name} not written)")
        return
    att = [r for r in rows if r["kind"] == "timing" and r["system"] == "attncc" and r.get("speedup_vs_peer_fwd")]
    shapes = list(dict.fromkeys(row_shape(r) for r in att))
    if not shapes:
        print(f"no attncc/peer pair measured: no chart ({path.name} not written)")
        return
    fig, axes = plt.subplots(len(shapes), 1, figsize=(11, 3.2 * len(shapes)), squeeze=False)
    for ax, shape in zip(axes[:, 0], shapes):
        rs = [r for r in att if row_shape(r) == shape]
        x = range(len(rs))
        for dx, part in ((-0.2, "fwd"), (0.2, "bwd")):
            bars = ax.bar([i + dx for i in x], [r.get(f"speedup_vs_peer_{part}") or float("nan") for r in rs],
                          0.4, label=part)
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_yscale("log", base=2)
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:.3g}×"))
        ticks = [f"{r['variant']}\n({r['peer_best_fwd']} / {r['peer_best_bwd']})" for r in rs]
        ax.set_xticks(list(x), ticks, rotation=0, fontsize=7)
        ax.set_title(f"B×H×N×D = {shape}", fontsize=10)
        ax.set_ylabel("attncc / fastest peer")
    axes[0, 0].legend()
    fig.suptitle(f"attncc against the fastest of {', '.join(STRONGEST)} per cell "
                 f"(else {' / '.join(FALLBACK)}), {att[0]['dtype']}, {att[0]['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def merge(into: Path, parts):
    """Rows of other runs' results files (bench.py --out elsewhere: one process per GPU) merged into
    `into` as bench.py merges its own (a part's rows replace those of the same key), chart redrawn."""
    for part in parts:
        rows = save(json.loads(Path(part).read_text()), {}, into)
    plot(rows, into.with_suffix(".png"))


if __name__ == "__main__":
    import sys
    if len(sys.argv) < 4 or sys.argv[1] != "merge":
        sys.exit("usage: python benchmarks/report.py merge INTO.json PART.json [PART.json ...]")
    merge(Path(sys.argv[2]), sys.argv[3:])
