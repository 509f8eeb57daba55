"""Section 4 of BENCHMARKS.md: the simulator's speed against libCacheSim's cachesim, from
RESULTS_DIR/sim/sim-speed.csv (written by bench/sim-speed)."""
import csv
import os
import statistics


def section(res):
    path = os.path.join(res, "sim", "sim-speed.csv")
    if not os.path.exists(path):
        return []
    rows = list(csv.DictReader(open(path)))
    groups = {}
    for r in rows:
        groups.setdefault((r["trace"], r["policy"], r["tool"]), []).append(r)
    med = {k: statistics.median(float(r["req_per_cpu_s"]) for r in v) for k, v in groups.items()}
    miss = {k: v[0]["miss_ratio"] for k, v in groups.items()}
    runs = max(len(v) for v in groups.values())
    out = ["## 4. Simulator speed", ""]
    out.append(
        "Block references simulated per CPU second (user + system time of the whole process, trace "
        "reading and start-up included; median of %d run%s), one cache of 10%% of the trace's unique "
        "4 KiB blocks, one thread each, on the same oracleGeneral file of 4 KiB block references "
        "(`bench/sim-speed`). The miss ratios must agree for the algorithms both tools implement, or "
        "the script fails." % (runs, "" if runs == 1 else "s"))
    out.append("")
    have_cachesim = any(k[2] == "cachesim" for k in med)
    out.append("| trace | policy | ssdcache simulate | cachesim | × cachesim | miss ratio |")
    out.append("|---|---|---:|---:|---:|---:|")
    for trace, policy in sorted({(k[0], k[1]) for k in med}):
        ours = med.get((trace, policy, "ssdcache"))
        theirs = med.get((trace, policy, "cachesim"))
        cells = [trace, policy,
                 f"{ours / 1e6:.2f} M/s" if ours else "—",
                 f"{theirs / 1e6:.2f} M/s" if theirs else "—",
                 f"**{ours / theirs:.2f}**" if ours and theirs else "—",
                 miss.get((trace, policy, "ssdcache"), "—")]
        out.append("| " + " | ".join(cells) + " |")
    out.append("")
    if have_cachesim:
        out.append("Target: at least as fast as cachesim for LRU and for the default policy; the × column "
                   "says whether it is met (≥ 1.00).")
    else:
        out.append("cachesim was not built for this run (`bench/libcachesim/build`, or set `$CACHESIM`): "
                   "ssdcache's rate is shown alone and the target is not evaluated.")
    out.append("")
    return out
