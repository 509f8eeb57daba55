"""Section 1 of BENCHMARKS.md: the cache in front of the HDD model (used by report.py).

Reads RESULTS_DIR/hdd/*.meta.json + *.fio.json written by bench/hdd.sh.
"""
import glob
import json
import os
import statistics

TARGETS = ["hdd", "nbdkit", "ssd-wt", "ssd-wb", "ssd-wa", "ssd-pt"]
LABEL = {
    "hdd": "raw HDD model",
    "nbdkit": "nbdkit --filter=cache",
    "ssd-wt": "ssdcache write-through",
    "ssd-wb": "ssdcache write-back",
    "ssd-wa": "ssdcache write-around",
    "ssd-pt": "ssdcache pass-through",
}
WORKLOADS = ["db", "zipf", "seqread", "seqwrite", "randwrite"]
WL_LABEL = {
    "db": "database model: randrw 75/25, 4 KiB, QD64",
    "zipf": "zipf:1.2 randrw 90/10, 4 KiB, 4 jobs × QD8",
    "seqread": "sequential read, 1 MiB, QD8",
    "seqwrite": "sequential write, 1 MiB, QD8",
    "randwrite": "random write, 4 KiB, QD32",
    "trace": "trace replay",
}
WL_SHORT = {"db": "database", "zipf": "zipf", "seqread": "seq read 1M", "seqwrite": "seq write 1M",
            "randwrite": "rand write 4K", "trace": "trace"}
SSD = ("ssd-wt", "ssd-wb", "ssd-wa", "ssd-pt")


def load(res):
    cells = {}
    hres = os.path.join(res, "hdd")
    for mp in sorted(glob.glob(os.path.join(hres, "*.meta.json"))):
        m = json.load(open(mp))
        fp = mp.replace(".meta.json", ".fio.json")
        try:
            j = json.load(open(fp))["jobs"][0]
        except (OSError, ValueError, KeyError, IndexError):
            continue
        r, w = j["read"], j["write"]

        def pct(d, k):
            p = d.get("clat_ns", {}).get("percentile", {})
            v = p.get(k)
            return v / 1000 if v else None

        c = dict(m)
        c.update(
            iops=r["iops"] + w["iops"],
            riops=r["iops"], wiops=w["iops"],
            mbs=(r["bw_bytes"] + w["bw_bytes"]) / 1e6,
            ios=r["total_ios"] + w["total_ios"],
            rp50=pct(r, "50.000000"), rp99=pct(r, "99.000000"), rp999=pct(r, "99.900000"),
            wp50=pct(w, "50.000000"), wp99=pct(w, "99.000000"), wp999=pct(w, "99.900000"),
            runtime_ms=j.get("job_runtime"),
        )
        cells[m["cell"]] = c
    return cells


def get(cells, target, wl, ws, state):
    """The cell for (target, wl, ws, state); stateless targets answer every state."""
    for st in (state, "any"):
        c = cells.get(f"{target}.{wl}.{ws}.{st}")
        if c:
            return c
    return None


def ratio(a, b):
    if not a or not b or not b["iops"]:
        return None
    return a["iops"] / b["iops"]


def fx(x, d=2):
    if x is None:
        return "—"
    return f"{x:,.0f}×" if x >= 100 else f"{x:.{d}f}×"


def fus(x):
    if x is None:
        return "—"
    return f"{x / 1000:,.1f} ms" if x >= 10000 else f"{x:,.0f} µs"


def key_ratios(cells, hit_pair=None):
    """Named ratios compared between runs and evaluated against the issue's targets."""
    k = {}
    for ws in ("in", "out"):
        for wl in WORKLOADS + ["trace"]:
            for st in ("cold", "warm"):
                hdd = get(cells, "hdd", wl, ws, st)
                nk = get(cells, "nbdkit", wl, ws, st)
                for t in ("nbdkit",) + SSD:
                    c = get(cells, t, wl, ws, st)
                    if t in ("ssd-pt",) and st == "warm":
                        continue  # same cell as cold
                    r = ratio(c, hdd)
                    if r is not None:
                        k[f"{t} / HDD, {WL_SHORT[wl]}, ws {ws}, {st if t != 'ssd-pt' else 'any'}"] = r
                    if t != "nbdkit":
                        r = ratio(c, nk)
                        if r is not None and t in ("ssd-wt", "ssd-wb"):
                            k[f"{t} / nbdkit, {WL_SHORT[wl]}, ws {ws}, {st}"] = r
                    if t == "ssd-wb":
                        r = ratio(c, get(cells, "ssd-wt", wl, ws, st))
                        if r is not None:
                            k[f"ssd-wb / ssd-wt, {WL_SHORT[wl]}, ws {ws}, {st}"] = r
    if hit_pair:
        k["hit path: ssdcache / nbdkit file cache=none"] = hit_pair[0] / hit_pair[1]
    return k


def goals(cells, hit_pair):
    """(goal text, measured text, met: bool|None, detail)"""
    out = []
    hdd = get(cells, "hdd", "db", "in", "warm")
    nk = get(cells, "nbdkit", "db", "in", "warm")
    # Evaluated on the best caching mode measured (write-back when present: only it acknowledges
    # writes before the hard drive has them), with the others alongside.
    best = next((t for t in ("ssd-wb", "ssd-wt") if get(cells, t, "db", "in", "warm")), None)
    bc = get(cells, best, "db", "in", "warm") if best else None
    r1, r2 = ratio(bc, hdd), ratio(bc, nk)
    others = ", ".join(f"{LABEL[t].split()[-1]} {fx(ratio(get(cells, t, 'db', 'in', 'warm'), hdd), 1)}"
                       for t in SSD if t != best and get(cells, t, "db", "in", "warm"))
    mode = LABEL[best].split()[-1] if best else ""
    out.append(("warm database model, working set inside the cache: ssdcache ≥ 50× the raw HDD model",
                f"{fx(r1, 1)} ({mode} {bc['iops']:,.0f} vs {hdd['iops']:,.0f} IOPS"
                + (f"; {others}" if others else "") + ")" if r1 else "not measured",
                None if r1 is None else r1 >= 50))
    wt = get(cells, "ssd-wt", "db", "in", "warm")
    r2wt = ratio(wt, nk) if best != "ssd-wt" else None
    out.append(("… and ≥ 10× `nbdkit --filter=cache`",
                f"{fx(r2, 2)} ({mode} {bc['iops']:,.0f} vs {nk['iops']:,.0f} IOPS"
                + (f"; write-through {fx(r2wt, 2)}" if r2wt else "") + ")" if r2 else "not measured",
                None if r2 is None else r2 >= 10))
    if hit_pair:
        r = hit_pair[0] / hit_pair[1]
        out.append(("100% hit reads: ≥ 1.0× `nbdkit file` on the cache file (section 2)",
                    f"{r:.2f}× ({hit_pair[0]:,.0f} vs {hit_pair[1]:,.0f} IOPS)", r >= 1.0))
    worst = []
    for wl in WORKLOADS:
        for st in ("cold", "warm"):
            h = get(cells, "hdd", wl, "out", st)
            for t in SSD:
                if t == "ssd-pt" and st == "warm":
                    continue  # one cell ("any")
                c = get(cells, t, wl, "out", st)
                r = ratio(c, h)
                if r is not None:
                    worst.append((r, f"{LABEL[t]}, {WL_SHORT[wl]}, {st if t != 'ssd-pt' else 'any'}"))
    if worst:
        worst.sort()
        below = [f"{n} {r:.2f}×" for r, n in worst if r < 0.95]
        out.append(("working set twice the cache: never slower than the raw HDD model (every workload, "
                    "mode and state; slower = below 0.95×, since single cells move by ±5–10% between runs)",
                    f"lowest {worst[0][0]:.2f}× ({worst[0][1]}); "
                    + (f"{len(below)} of {len(worst)} cells below 0.95×: " + "; ".join(below) if below
                       else f"all {len(worst)} cells ≥ 0.95×"),
                    worst[0][0] >= 0.95))
    wb_rw = [(st, get(cells, "ssd-wb", "randwrite", "out", st), get(cells, "hdd", "randwrite", "out", st))
             for st in ("cold", "warm")]
    wb_rw = [(st, c, ratio(c, h)) for st, c, h in wb_rw if ratio(c, h) is not None]
    if wb_rw:
        lo = min(r for _, _, r in wb_rw)
        out.append(("working set twice the cache: write-back random 4 KiB writes ≥ 1.5× the raw HDD model "
                    "(with the share of writes the cache absorbed)",
                    "; ".join(f"{st} {r:.2f}× (absorbed {fpct(c.get('absorbed_share'))})" for st, c, r in wb_rw),
                    lo >= 1.5))
    seq, seq_in = [], []
    for ws, acc in (("out", seq), ("in", seq_in)):
        h = get(cells, "hdd", "seqread", ws, "cold")
        for t in SSD:
            r = ratio(get(cells, t, "seqread", ws, "cold"), h)
            if r is not None:
                acc.append((r, f"{LABEL[t].split()[-1]} {r:.2f}×"))
    if seq:
        lo = min(r for r, _ in seq)
        extra = ""
        if seq_in:
            extra = ("; the 256 MiB cells, about 1 s each and so dominated by the first requests' latency: "
                     + ", ".join(n for _, n in seq_in))
        out.append(("sequential 1 MiB reads of cold data: within 10% of the raw HDD model "
                    "(evaluated on the 1 GiB working set: 4–5 s per cell)",
                    f"lowest {lo:.2f}× (" + "; ".join(n for _, n in seq) + extra + ")", lo >= 0.9))
    return out


def fpct(share):
    return "—" if share is None else f"{share * 100:.0f}%"


def fmib(b):
    return "—" if b is None else f"{b / 2**20:,.0f} MiB"


def randwrite_table(cells, he):
    """Random 4 KiB writes at QD32: write-back vs write-through vs the raw HDD model."""
    rows = []
    for ws in ("in", "out"):
        for st in ("cold", "warm"):
            wb, wt, hdd = (get(cells, t, "randwrite", ws, st) for t in ("ssd-wb", "ssd-wt", "hdd"))
            if wb or wt:
                rows.append((ws, st, wb, wt, hdd))
    if not rows:
        return []
    out = []
    w = out.append
    w("### Random 4 KiB writes at QD32: write-back vs write-through vs raw HDD model")
    w("")
    w("`fio --rw=randwrite --bs=4k --iodepth=32` (time based), the rows of *rand write 4K* in the tables "
      "below, side by side. Write-back acknowledges a write once the SSD has it (a FLUSH or FUA makes it "
      "durable, through a journal commit); write-through once the hard drive has it too. *dirty at the end*, *written back* "
      "and *around a full cache* are write-back's `dirty_bytes` after the cell and the growth of "
      "`bytes_cleaned` and `bytes_written_around_full` during it (`ssdcache stats --json`); *absorbed* is "
      "the share of the bytes written after fio's ramp that the cache took (into a dirty line, or a line "
      "the cleaner freed) instead of sending them around a cache at its dirty limit.")
    w("")
    w("| working set | state | write-back IOPS | write-through IOPS | raw HDD IOPS | write-back × HDD | "
      "write-through × HDD | write-back × write-through | write p99: write-back / write-through / HDD | "
      "dirty at the end | written back | around a full cache | absorbed |")
    w("|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|")
    for ws, st, wb, wt, hdd in rows:
        ws_l = f"{he['ws_in_mib'] if ws == 'in' else he['ws_out_mib']} MiB"
        iops = lambda c: f"{c['iops']:,.0f}" if c else "—"
        p99 = " / ".join(fus(c["wp99"]) if c else "—" for c in (wb, wt, hdd))
        w(f"| {ws_l} | {st} | **{iops(wb)}** | {iops(wt)} | {iops(hdd)} | **{fx(ratio(wb, hdd), 1)}** | "
          f"{fx(ratio(wt, hdd), 2)} | {fx(ratio(wb, wt), 1)} | {p99} | "
          f"{fmib(wb.get('end_dirty_bytes')) if wb else '—'} | {fmib(wb.get('d_bytes_cleaned')) if wb else '—'} | "
          f"{fmib(wb.get('d_bytes_written_around_full')) if wb else '—'} | {fpct(wb.get('absorbed_share')) if wb else '—'} |")
    w("")
    return out


def warmup_rows(res, he):
    rows = []
    hres = os.path.join(res, "hdd")
    for t in SSD:
        for ws in ("in", "out"):
            p0, p1 = (os.path.join(hres, f"{t}.{ws}.warmup.stats{i}.json") for i in (0, 1))
            fj = os.path.join(hres, f"{t}.{ws}.warmup.json")
            try:
                v0 = json.load(open(p0))["volumes"][0]
                v1 = json.load(open(p1))["volumes"][0]
                secs = json.load(open(fj))["jobs"][0]["job_runtime"] / 1000
            except (OSError, ValueError, KeyError, IndexError):
                continue
            rows.append(dict(t=t, ws_mib=he["ws_in_mib"] if ws == "in" else he["ws_out_mib"], secs=secs,
                             read_mib=(v1["bytes_read"] - v0["bytes_read"]) / 2**20,
                             bypassed_mib=(v1["bytes_bypassed"] - v0["bytes_bypassed"]) / 2**20,
                             occ_mib=v1.get("occupancy_bytes", 0) / 2**20))
    return rows


def verdict(met):
    return "—" if met is None else ("**met**" if met else "**missed**")


def section(res, env, hit_pair, plots, compare):
    cells = load(res)
    he = env["hdd"]
    out = []
    w = out.append
    w("## 1. The cache in front of a hard drive (HDD model)")
    w("")
    w(f"Backing: a {he['backing_size'].replace('G', ' GiB')} file (the first {he['ws_out_mib']} MiB written with real data) "
      "behind the HDD model of `ssdcache hdd-emulator` (7200 rpm, full stroke = the whole file, NCQ 32, "
      "no write cache; ≈ 79 random 4 KiB IOPS at QD1, 150–200 at QD32, 250 → 125 MB/s sequential). "
      f"Cache: {he['cache_mib']} MiB of cache lines for both caches. Targets, all reached with fio's "
      "`nbd` engine over a Unix socket:")
    w("")
    w("* **raw HDD model**: `ssdcache hdd-emulator --file backing.img` over NBD;")
    w(f"* **nbdkit --filter=cache**: nbdkit's cache filter (`cache=writethrough cache-on-read=true "
      f"cache-max-size={he['cache_mib']}M`, 64 KiB blocks) over `nbdkit nbd` connected to the HDD model's "
      "socket. Its cache is a temporary file in `TMPDIR` (set to the scratch folder on ext4) read and "
      "written through the **page cache** (the machine has 23 GiB of RAM, so in practice its hits are "
      "memory copies, not SSD reads);")
    w("* **ssdcache write-through / write-back / write-around / pass-through**: `ssdcache create --mode M` "
      "(defaults: 64 KiB lines, sequential cutoff 4 MiB) and `ssdcache serve --emulate-hdd` (the same HDD "
      "model in-process, between the cache and the backing file). The cache file is on the same ext4/virtio "
      "disk, read and written with O_DIRECT. Write-back runs with the cleaner's defaults (`--writeback-high "
      "50 --writeback-low 40 --writeback-max-age 30`: below half the lines dirty it writes back only data "
      "older than 30 s, or when the backing device has had no client request for 100 ms); a stopped "
      "write-back cache still holds its dirty data, so the next cell starts from a new one (superblocks "
      "zeroed, then `create` again: the backing file is scratch).")
    w("")
    w(f"Working sets: **in** = {he['ws_in_mib']} MiB (half the cache), **out** = {he['ws_out_mib']} MiB "
      "(twice the cache), both from offset 0. **cold** = a fresh cache (`ssdcache create --force` "
      "again; nbdkit restarted with an empty temporary directory), measured at once, one fresh cache per "
      "cell. **warm** = per target and working set, one fresh cache, one warm-up pass, then the "
      "workloads back to back (database, zipf, sequential read, sequential write, random write: a later "
      "cell sees the earlier cells' writes, and for write-back their dirty data). Warm-up for ssdcache: the working set read once in 64 KiB requests (one "
      "cache line each) in random order at QD32 "
      f"(`fio --rw=randread --bs=64k --iodepth=32`, capped at {he.get('warm_cap', '?')} s), because "
      "ssdcache's stream detector (`create --sequential-cutoff`, default 4 MiB) sends sequential and large "
      "requests to the backing device by design; for nbdkit's filter: one sequential 1 MiB pass (it "
      "serialises misses, so the random pass would take minutes; it has no stream detection). The raw "
      "HDD model and pass-through have no cache state and are measured once per cell (shown as *any*).")
    w("")
    wu = warmup_rows(res, he)
    if wu:
        w("What the warm-up left in ssdcache's cache (`ssdcache stats --json` before/after the pass):")
        w("")
        w("| target | working set | pass time | read | bypassed | cache occupancy after |")
        w("|---|---:|---:|---:|---:|---:|")
        for r in wu:
            w(f"| {LABEL[r['t']]} | {r['ws_mib']} MiB | {r['secs']:.1f} s | {r['read_mib']:,.0f} MiB | "
              f"{r['bypassed_mib']:,.0f} MiB | {r['occ_mib']:,.0f} MiB ({r['occ_mib'] / min(r['ws_mib'], he['cache_mib']) * 100:.0f}% of "
              f"{'the working set' if r['ws_mib'] <= he['cache_mib'] else 'the cache'}) |")
        w("")
    w(f"Random workloads are time based ({he['ramp']} s ramp + {he['runtime']} s measured); sequential "
      f"ones read or write the working set once (capped at {he['seq_cap']} s). Every cell is one run "
      "(no repeats: see the run-to-run comparison for the noise).")
    w("")

    # ---- goals
    w("### Against the issue's targets")
    w("")
    w("| target | measured | verdict |")
    w("|---|---|---|")
    for g, m, met in goals(cells, hit_pair):
        w(f"| {g} | {m} | {verdict(met)} |")
    w("")
    w("Why the misses happen and what would close them: see *Findings: HDD section* at the end.")
    w("")
    out.extend(randwrite_table(cells, he))

    # ---- main table
    w("### Results")
    w("")
    w("IOPS count reads and writes; MB/s likewise. Latencies are fio completion latencies (clat) of "
      "reads, and p99 of writes. *hits*: the read hit ratio of the measured phase (`ssdcache stats "
      "--json` before/after; ssdcache targets only). Ratios are by IOPS (for sequential cells that is "
      "the same as by MB/s) against the raw HDD model on the same workload and working set, and against "
      "nbdkit's cache filter in the same state.")
    w("")
    for ws in ("in", "out"):
        w(f"#### Working set {'inside the cache' if ws == 'in' else 'twice the cache'} "
          f"({he['ws_in_mib'] if ws == 'in' else he['ws_out_mib']} MiB)")
        w("")
        w("| workload | state | target | IOPS | MB/s | read p50 | read p99 | read p99.9 | write p99 | hits "
          "| × HDD | × nbdkit cache |")
        w("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for wl in WORKLOADS:
            for st in ("cold", "warm"):
                hdd = get(cells, "hdd", wl, ws, st)
                nk = get(cells, "nbdkit", wl, ws, st)
                for t in TARGETS:
                    c = get(cells, t, wl, ws, st)
                    if not c:
                        continue
                    if c["state"] == "any" and st == "warm":
                        continue  # printed once, under cold
                    stl = "any" if c["state"] == "any" else st
                    hits = f"{c['hit_ratio'] * 100:.0f}%" if c.get("hit_ratio") is not None else "—"
                    lab = f"**{LABEL[t]}**" if t == "ssd-wt" else LABEL[t]
                    w(f"| {WL_SHORT[wl]} | {stl} | {lab} | {c['iops']:,.0f} | {c['mbs']:.1f} | "
                      f"{fus(c['rp50'])} | {fus(c['rp99'])} | {fus(c['rp999'])} | {fus(c['wp99'])} | {hits} | "
                      f"{fx(ratio(c, hdd)) if t != 'hdd' else '1.00×'} | "
                      f"{fx(ratio(c, nk)) if t != 'nbdkit' else ('1.00×' if nk else '—')} |")
        w("")

    # ---- trace
    tj = os.path.join(res, "hdd", "trace.json")
    if os.path.exists(tj):
        t = json.load(open(tj))
        w("### Trace replay")
        w("")
        name = os.path.basename(t['trace'])
        source = (f"`mqsim/{name}` of the shared traces (DiskSim ASCII, MQSim's TPC-C trace)"
                  if name.startswith("tpcc") else
                  f"`{name}` (DiskSim ASCII, a synthetic trace of `bench/libcachesim/synthetic`, "
                  "written because SSDCACHE_TRACES was not set)")
        w(f"{source}: the first {t['requests']:,} requests ({t['reads']:,} reads, "
          f"{t['writes']:,} writes, mean {t['mean_kib']:.1f} KiB, {t['distinct_64k_lines']:,} distinct 64 KiB "
          f"lines), converted by `bench/trace2iolog.py` to a fio iolog v2 (offsets aligned down and lengths "
          f"up to 4 KiB, offsets folded modulo {t['region'] >> 20} MiB), replayed with "
          f"`fio --read_iolog=FILE --replay_no_stall=1 --iodepth=16` (capped at {he['trace_cap']} s): "
          "**cold** on a fresh target, then **warm** = the same requests again right after.")
        w("")
        w("| target | cold IOPS | cold read p99 | warm IOPS | warm read p99 | warm hits | cold × HDD | warm × HDD "
          "| warm × nbdkit cache |")
        w("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for tg in TARGETS:
            c, wm = cells.get(f"{tg}.trace.out.cold"), cells.get(f"{tg}.trace.out.warm")
            if not c or not wm:
                continue
            hc, hw = cells.get("hdd.trace.out.cold"), cells.get("hdd.trace.out.warm")
            nw = cells.get("nbdkit.trace.out.warm")
            hits = f"{wm['hit_ratio'] * 100:.0f}%" if wm.get("hit_ratio") is not None else "—"
            w(f"| {LABEL[tg]} | {c['iops']:,.0f} | {fus(c['rp99'])} | {wm['iops']:,.0f} | {fus(wm['rp99'])} | "
              f"{hits} | {fx(ratio(c, hc))} | {fx(ratio(wm, hw))} | {fx(ratio(wm, nw))} |")
        w("")

    # ---- plots
    if plots:
        w("### Plots")
        w("")
        cv = cells.get("curve")
        w(f"Warm-up curve: the database model on a cold ssdcache write-through cache, working set "
          f"{he['ws_in_mib']} MiB, {he['curve_s']} s; IOPS from `fio --write_iops_log --log_avg_msec=1000`, "
          "read hit ratio per second from `ssdcache stats --json` sampled every second"
          + (f" (whole run: {cv['iops']:,.0f} IOPS, {cv['hit_ratio'] * 100:.0f}% hits)"
             if cv and cv.get("hit_ratio") is not None else "") + ".")
        w("")
        w(f"![warm-up curve]({plots}/warmup.svg)")
        w("")
        w("Read latency distribution of the warm database model (working set inside the cache), per target:")
        w("")
        w(f"![latency CDF]({plots}/latency-cdf.svg)")
        w("")

    # ---- run vs run
    if compare and "," in compare:
        a, b = compare.split(",", 1)
        out.extend(compare_section(a, b, None))
    elif compare:
        out.extend(compare_section(compare, res, hit_pair))
    return out


def hit_pair_of(res):
    # median hit-path IOPS of ssdcache and nbdkit cache=none, from report.load
    import report
    keys, runs, med = report.load(res)
    if "ssdcache" in med and "nbdkit-none" in med:
        return med["ssdcache"]["iops"], med["nbdkit-none"]["iops"]
    return None


def seed_changed(old, new):
    """Run 1 made before the warm-up got its own random seed: its warm cells of the large
    working set are not comparable (see bench/hdd.sh, warmup)."""
    eo = json.load(open(os.path.join(old, "env.json"))).get("hdd") or {}
    en = json.load(open(os.path.join(new, "env.json"))).get("hdd") or {}
    return eo.get("warm_seed") != en.get("warm_seed")


def compare_rows(old, new, hit_new=None):
    ko = key_ratios(load(old), hit_pair_of(old))
    kn = key_ratios(load(new), hit_new or hit_pair_of(new))
    skip = seed_changed(old, new)
    rows = []
    for k in kn:
        if skip and "ws out, warm" in k:
            continue
        if k in ko and ko[k] and kn[k]:
            rows.append((k, ko[k], kn[k], kn[k] / ko[k] - 1))
    return rows


def compare_section(old, new, hit_new):
    rows = compare_rows(old, new, hit_new)
    out = []
    w = out.append
    w("### Run 1 vs run 2 (reproducibility)")
    w("")
    if not rows:
        w("No common cells.")
        return out + [""]
    oe = json.load(open(os.path.join(old, "env.json")))
    ch = sorted(abs(r[3]) for r in rows)
    within = sum(1 for c in ch if c <= 0.10)
    ne = json.load(open(os.path.join(new, "env.json")))
    w(f"The same ratios from two full runs: run 1 ({oe['date']}, results `{os.path.basename(os.path.normpath(old))}`) "
      f"and run 2 ({ne['date']}, `{os.path.basename(os.path.normpath(new))}`). Of {len(rows)} ratios, "
      f"**{within} moved by 10% or less**; median movement {statistics.median(ch) * 100:.1f}%, "
      f"largest {ch[-1] * 100:.0f}%. Ratios of two HDD-bound targets are noisiest: one cell is one "
      "short run over a few thousand random requests, and the model's rotational position is real time.")
    w("")
    if seed_changed(old, new):
        w("Left out: the warm cells of the 1 GiB working set. In at least one of these runs the warm-up was "
          "seeded like the measured cells (fio 3.33 with `randrepeat=1` ignores `--randseed`), so the partial "
          "warm-up had cached exactly the blocks the cell then read first (94% hits for uniform reads over "
          "twice the cache, where ~25% is possible): wrong, not noisy. The warm-up now uses `--randrepeat=0`.")
        w("")
    w("| ratio | run 1 | run 2 | change |")
    w("|---|---:|---:|---:|")
    for k, a, b, c in rows:
        flag = " ⚠" if abs(c) > 0.10 else ""
        w(f"| {k} | {a:.2f}× | {b:.2f}× | {c * 100:+.0f}%{flag} |")
    w("")
    w("⚠ = moved by more than 10%.")
    w("")
    return out


def compare_summary(old, new):
    rows = compare_rows(old, new)
    print(f"{'ratio':<64} {'run 1':>8} {'run 2':>8} {'change':>7}")
    for k, a, b, c in rows:
        print(f"{k:<64} {a:>8.2f} {b:>8.2f} {c * 100:>+6.0f}%")
    if rows:
        ch = sorted(abs(r[3]) for r in rows)
        print(f"{sum(1 for c in ch if c <= 0.1)} of {len(rows)} within 10%; median {statistics.median(ch) * 100:.1f}%")


def summary(res):
    cells = load(res)
    print(f"{'HDD section cell':<34} {'IOPS':>9} {'MB/s':>8} {'hits':>6} {'x HDD':>7}")
    for name in sorted(cells):
        c = cells[name]
        if name == "curve":
            continue
        h = get(cells, "hdd", c["workload"], c["ws"], c["state"] if c["state"] != "any" else "cold")
        r = ratio(c, h)
        hit = f"{c['hit_ratio'] * 100:.0f}%" if c.get("hit_ratio") is not None else "-"
        print(f"{name:<34} {c['iops']:>9.0f} {c['mbs']:>8.1f} {hit:>6} {r if r is None else round(r, 2)!s:>7}")
    for g, m, met in goals(cells, hit_pair_of(res)):
        print(f"- {g}: {m} -> {'met' if met else 'MISSED' if met is not None else '-'}")
