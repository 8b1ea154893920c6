"""Where a kernel's warps wait, instruction by instruction, from Nsight Compute's source page.

    ncu --section SourceCounters --section WarpStateStats -o k python3 some_script.py
    ncu -i k.ncu-rep --page source --csv --print-source sass > k-source.csv
    python scripts/ncu_sass_stalls.py k-source.csv [--top 25] [--around GMMA]

Prints the total of stall samples, the `--top` instructions by samples with their two largest
stall reasons, and every instruction from 20 before the first to 20 after the last whose text
contains `--around` (default "GMMA": the main loop of a wgmma kernel), so a loop can be read
with its costs beside it. Only the report's first kernel is read.
"""

import argparse
import csv
import sys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source_csv")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--around", default="GMMA")
    args = parser.parse_args()
    try:
        rows = list(csv.reader(open(args.source_csv, newline="")))
        header = next(r for r in rows if "Source" in r and "Warp Stall Sampling (All Samples)" in r)
    except (OSError, StopIteration) as exc:
        sys.exit(f"ncu_sass_stalls.py: no ncu source page in {args.source_csv}: {exc}")
    body = rows[rows.index(header) + 1:]
    body = body[:next((i for i, r in enumerate(body) if len(r) < len(header) // 2), len(body))]  # first kernel
    source, samples = header.index("Source"), header.index("Warp Stall Sampling (All Samples)")
    reasons = [(i, h[len("stall_"):]) for i, h in enumerate(header) if h.startswith("stall_") and "Not Issued" not in h]

    def count(row, i):
        return int(row[i]) if row[i].isdigit() else 0

    def line(n):
        row = body[n]
        top = sorted(((count(row, i), name) for i, name in reasons), reverse=True)[:2]
        why = " ".join(f"{name}:{c}" for c, name in top if c)
        return f"{n:5d} {count(row, samples):6d}  {row[source].strip()[:70]:70s} {why}"

    total = sum(count(r, samples) for r in body)
    print(f"# {total} stall samples over {len(body)} instructions")
    print(f"\n# the {args.top} instructions with the most samples")
    for n in sorted(sorted(range(len(body)), key=lambda n: -count(body[n], samples))[:args.top]):
        print(line(n))
    hits = [n for n, r in enumerate(body) if args.around in r[source]]
    if hits:
        print(f"\n# from 20 before the first to 20 after the last instruction containing {args.around!r}")
        for n in range(max(0, hits[0] - 20), min(len(body), hits[-1] + 21)):
            print(line(n))


if __name__ == "__main__":
    main()
