"""Where a kernel's warps stall, from ncu's per-instruction source page.

    ncu --kernel-name regex:indexer_bwd_kernel --launch-skip 2 --launch-count 1 --set full -o rep \
        python3 tools/profile_kernel.py idx-v32 bwd
    ncu -i rep.ncu-rep --page source --csv --print-source sass | gzip > rep_source.csv.gz
    python3 tools/ncu_stalls.py rep_source.csv.gz [--top 25]

Splits the warp-state samples between the consumer warpgroup and the producer
by the SASS role markers (code after `USETMAXREG.DEALLOC` up to the next
`EXIT` is the producer's; the rest, before it, the consumer's; out-of-line
code after that is reported apart), counts the loop that issues bulk
reductions (the instructions from the first `ELECT` before a `UBLKRED` to the
`BRA.U.ANY` after it), the samples each role spends in mbarrier waits (a
`SYNCS.PHASECHK` try-wait and the branch on its predicate), and lists the
hottest instructions with their main stall reasons. docs/PERFORMANCE.md §19
reads the indexer backward this way, §27 attn_dist.
"""

import argparse
import csv
import gzip
import io


def load(path):
    text = gzip.open(path, "rt").read() if path.endswith(".gz") else open(path).read()
    rows = list(csv.reader(io.StringIO(text)))
    start = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    header, data = rows[start], [r for r in rows[start + 1:] if len(r) == len(rows[start])]
    return header, data


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    header, data = load(args.csv)
    col = {h: i for i, h in enumerate(header)}
    samples = [float(r[col["Warp Stall Sampling (All Samples)"]] or 0) for r in data]
    source = [r[col["Source"]].strip() for r in data]
    reasons = [h for h in header if h.startswith("stall_") and "(Not" not in h]
    total = sum(samples)

    dealloc = next(i for i, s in enumerate(source) if "USETMAXREG.DEALLOC" in s)
    producer_end = next(i for i in range(dealloc, len(source)) if source[i].split()[-1:] == ["EXIT"])
    # The reduction-issue loops: ELECT ... UBLKRED ... BRA.U.ANY, in the consumer.
    loop = set()
    for i, s in enumerate(source[:dealloc]):
        if "UBLKRED" in s:
            lo = max(j for j in range(i) if "ELECT" in source[j])
            hi = next(j for j in range(i, dealloc) if "BRA.U.ANY" in source[j])
            loop.update(range(lo, hi + 1))

    # mbarrier waits: a SYNCS.PHASECHK try-wait and the branch that tests its
    # predicate (to the out-of-line retry) within the next few instructions.
    waits = set()
    for i, s in enumerate(source):
        if "SYNCS.PHASECHK" in s and "TRYWAIT" in s:
            pred = s.split("TRYWAIT")[1].split(",")[0].strip()
            branch = next((j for j in range(i + 1, min(i + 12, len(source)))
                           if source[j].split()[:2] == [f"@!{pred}", "BRA"]), None)
            if branch is not None:
                waits.update((i, branch))

    def share(indices):
        return sum(samples[i] for i in indices) / total * 100

    consumer = range(0, dealloc)
    producer = range(dealloc, producer_end + 1)
    print(f"samples {total:.0f}: consumer {share(consumer):.1f} %, producer {share(producer):.1f} %, "
          f"out-of-line {share(range(producer_end + 1, len(data))):.1f} %")
    if loop:
        print(f"reduction-issue loop: {share(loop):.1f} % of all samples, "
              f"{share(loop) / share(consumer) * 100:.1f} % of the consumer's")
    for name, part in (("consumer", consumer), ("producer", producer)):
        by = {h: sum(float(data[i][col[h]] or 0) for i in part) for h in reasons}
        part_total = sum(samples[i] for i in part) or 1
        print(f"{name} in mbarrier waits: {sum(samples[i] for i in part if i in waits) / part_total * 100:.1f} % "
              f"of its samples")
        print(f"{name} by reason: " + ", ".join(f"{h[6:]} {v / part_total * 100:.1f} %"
                                                  for h, v in sorted(by.items(), key=lambda x: -x[1])
                                                  if v / part_total > 0.01))
    print(f"hottest {args.top} instructions:")
    for i in sorted(range(len(data)), key=lambda i: -samples[i])[:args.top]:
        top = sorted(((h[6:], float(data[i][col[h]] or 0)) for h in reasons), key=lambda x: -x[1])[:2]
        role = "C" if i < dealloc else ("P" if i <= producer_end else "-")
        print(f"  {role} {samples[i] / total * 100:5.1f} %  {source[i][:64]:64s} "
              + " ".join(f"{r} {v / total * 100:.1f}" for r, v in top if v > 0))


if __name__ == "__main__":
    main()
