"""Rebuild bench.py's result rows from what it printed, for a run whose JSON did not come back
(the GPU machine returns a limited number of files), and merge them into
benchmarks/results/<gpu>.json like bench.py does.

    python benchmarks/rows_from_log.py COMMIT LOG [LOG ...]

Each log is one bench.py run's stdout: its environment line, the progress lines (attncc's check
against the reference system) and the markdown table (milliseconds to 3 decimals, notes). The
rows keep that precision; fwd+bwd is their sum, and attncc's check holds the largest error only
(``check_errors={"max": ...}``). COMMIT replaces the commit the machine's checkout named.
"""
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import RESULTS, TOL, timing_row  # noqa: E402
from report import plot, save  # noqa: E402
from variants import density, make_cases  # noqa: E402

ENV = re.compile(r"gpu (.*?) torch (\S+) triton (\S+) attncc (\S+) attncc_commit \S+ cuda (\S+) dtype (\S+) "
                 r"warmup_ms (\d+) rep_ms (\d+) date (.*)")
CHECK = re.compile(r"attncc\s+(\S+)\s+(\S+)\s+fwd .*check vs (.*?): max rel err (\S+)")


def rows_of(text: str, commit: str):
    m = ENV.search(text)
    env = dict(gpu=m[1], torch=m[2], triton=m[3], attncc=m[4], attncc_commit=commit, cuda=m[5], dtype=m[6],
               warmup_ms=int(m[7]), rep_ms=int(m[8]), date=m[9].strip())
    checks = {(c[1], c[2]): (c[3], float(c[4])) for c in map(CHECK.match, text.splitlines()) if c}
    rows, densities = [], {}
    for line in text.splitlines():
        if not line.startswith("| ") or line.startswith("| variant"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        variant, shape, system, fwd, bwd, note = *cells[:5], cells[-1] or None
        B, H, N, D = (int(x) for x in shape.split("×"))
        case = make_cases(H, N, "cpu")[variant]
        if (variant, N) not in densities:
            densities[(variant, N)] = density(case.mask_mod, N, "cpu")
        base = dict(variant=variant, B=B, H=H, Hkv=H // case.gqa, N=N, D=D, density=densities[(variant, N)])
        fwd_ms, bwd_ms = (None if x == "n/a" else float(x) for x in (fwd, bwd))
        extra = {}
        if system == "attncc":
            ref, err = checks.get((variant, shape), (None, None))
            extra = dict(check_ref=ref, check_errors={"max": err} if ref else {"error": note},
                         check_ok=err < TOL if ref else None)
        both = fwd_ms + bwd_ms if fwd_ms is not None and bwd_ms is not None else None
        rows.append(timing_row(system, base, fwd_ms, bwd_ms, both, note, **extra))
    return rows, env


def main():
    commit, logs = sys.argv[1], sys.argv[2:]
    for log in logs:
        rows, env = rows_of(Path(log).read_text(), commit)
        path = RESULTS / (re.sub(r"[^a-z0-9]+", "-", env["gpu"].lower()).strip("-") + ".json")
        merged = save(rows, env, path)
        plot(merged, path.with_suffix(".png"))
        print(f"{log}: {len(rows)} rows into {path} ({len(merged)} rows)")


if __name__ == "__main__":
    main()
