#!/usr/bin/env python3
"""Turns the results folder written by bench/run into BENCHMARKS.md.

    report.py [--plots REL_DIR] [--compare OLD_RESULTS_DIR] RESULTS_DIR [ANALYSIS.md]
                                          -> Markdown on stdout
    report.py --summary RESULTS_DIR       -> short plain-text table on stdout
    report.py --compare-summary OLD_RESULTS_DIR RESULTS_DIR
                                          -> run-vs-run ratio movement, plain text

Section 1 (the cache over the HDD model, issue 3) is built by hddreport.section() from
RESULTS_DIR/hdd/; section 2 (cache-hit reads) from RESULTS_DIR/*.meta.json; section 3
(write-back) by wbreport.section() from RESULTS_DIR/wb/; section 4 (simulator speed) by
simreport.section(); section 5 (engine core, with the volumes table) by engine_section() from RESULTS_DIR/engine/engine.json
(written by `ssdcache-bench engine`).
"""
import glob
import json
import os
import statistics
import sys

import hddreport
import netreport
import simreport
import wbreport

ORDER = [
    "ssdcache",
    "ssdcache-lru",
    "ssdcache-crc128k",
    "ssdcache-metrics",
    "ssdcache-proxy",
    "ssdcache-proxy-tls",
    "ssdcache-t16",
    "nbdkit-none",
    "nbdkit-default",
    "nbdkit-memory",
    "fio-direct",
]
APPLES = "nbdkit-none"  # the apples-to-apples reference (reads reach the disk)
PAGE_CACHE = "nbdkit-default"  # the file from the page cache (no disk)
CEILING = "nbdkit-memory"  # transport ceiling (RAM, no disk): issue 11's reference
# Issue 11's reference for server CPU per hit: "about 20 µs of server CPU per request" when it was
# written (BENCHMARKS.md of 2026-11-20); the target is at most half of that.
CPU_PER_HIT_BEFORE_US = 20.0
DEVICE = "fio-direct"


def issue11_hit_targets(w, ss, ceil, dev):
    """Issue 11: hits at >= 0.8x the transport's ceiling, server CPU per hit at most half of before."""
    parts = []
    if ceil:
        r = ratio(ss["iops"], ceil["iops"])
        verdict = "**met**" if r >= 0.8 else "**not met**"
        part = (f"ssdcache ≥ 0.8× nbdkit memory (the transport's ceiling): {verdict}, {r:.2f}× "
                f"({ss['iops']:,.0f} vs {ceil['iops']:,.0f} IOPS)")
        if dev:
            part += (f"; the cache device itself, read by fio with io_uring and O_DIRECT and no NBD at all, "
                     f"reaches {ratio(dev['iops'], ceil['iops']):.2f}× of that ceiling, and a cache that reads "
                     "its device for every hit cannot serve more than its device delivers")
        parts.append(part)
    cpu = ss.get("server_cpu_s_per_m")
    if cpu:
        limit = CPU_PER_HIT_BEFORE_US / 2
        verdict = "**met**" if cpu <= limit else "**not met**"
        parts.append(f"server CPU per hit at most half of the {CPU_PER_HIT_BEFORE_US:.0f} µs measured when the "
                     f"issue was written (≤ {limit:.0f} µs): {verdict}, {cpu:.1f} µs")
    if parts:
        w("")
        w("Issue 11's hit-path targets: " + "; ".join(parts) + ".")


def load(res):
    runs = {}
    for meta_path in sorted(glob.glob(os.path.join(res, "*.meta.json"))):
        meta = json.load(open(meta_path))
        fio = json.load(open(meta_path.replace(".meta.json", ".fio.json")))
        job = fio["jobs"][0]
        read = job["read"]
        pct = read["clat_ns"]["percentile"]
        iops = read["iops"]
        run = dict(meta)
        run.update(
            iops=iops,
            mbs=read["bw_bytes"] / 1e6,
            p50=pct["50.000000"] / 1000,
            p99=pct["99.000000"] / 1000,
            p999=pct["99.900000"] / 1000,
            ios=read["total_ios"],
            fio_cpu_s_per_m=(job["usr_cpu"] + job["sys_cpu"]) / 100 / iops * 1e6 if iops else None,
        )
        if meta["server_pid"] and meta["window_seconds"] > 0 and iops:
            run["server_cpu_s_per_m"] = meta["cpu_seconds"] / meta["window_seconds"] / iops * 1e6
            run["server_cpu_util"] = meta["cpu_seconds"] / meta["window_seconds"]
        else:
            run["server_cpu_s_per_m"] = None
            run["server_cpu_util"] = None
        runs.setdefault(meta["key"], []).append(run)
    keys = [k for k in ORDER if k in runs] + sorted(k for k in runs if k not in ORDER)
    median = {}
    for key in keys:
        rounds = sorted(runs[key], key=lambda r: r["iops"])
        median[key] = rounds[(len(rounds) - 1) // 2]  # lower median for even counts
    return keys, runs, median


def fmt(x, digits=1):
    return "—" if x is None else f"{x:,.{digits}f}"


def ratio(a, b):
    return a / b if b else float("nan")


def summary(res):
    keys, runs, med = load(res)
    print(f"{'target':<44} {'IOPS':>9} {'p50 us':>8} {'p99 us':>8} {'srv CPU s/M':>11}  rounds (IOPS)")
    for k in keys:
        m = med[k]
        rounds = " ".join(f"{r['iops']:.0f}" for r in sorted(runs[k], key=lambda r: r["round"]))
        print(f"{m['label']:<44} {m['iops']:>9.0f} {m['p50']:>8.0f} {m['p99']:>8.0f} "
              f"{fmt(m['server_cpu_s_per_m']):>11}  {rounds}")
    if "ssdcache" in med and APPLES in med:
        print(f"ssdcache / nbdkit file cache=none = {ratio(med['ssdcache']['iops'], med[APPLES]['iops']):.2f}x")


def fsize(b):
    return f"{b >> 30} GiB" if b >= 1 << 30 and b % (1 << 30) == 0 else f"{b >> 20} MiB"


def load_engine(res):
    path = os.path.join(res, "engine", "engine.json")
    if not os.path.exists(path):
        return None
    e = json.load(open(path))
    cutoff = os.path.join(res, "engine", "engine-hits-cutoff.json")
    if os.path.exists(cutoff):
        e["hits_cutoff"] = json.load(open(cutoff)).get("hits")
    return e


def beside(r):
    b = r.get("hits_beside")
    if not b:
        return "— | — |"
    alone, near = b["reader_alone"], b["reader_beside_writes"]
    return f"{alone['p99_us']:,.0f} | {near['p99_us']:,.0f} / {near['max_us']:,.0f} |"


def engine_section(res):
    """Section 5: the engine core alone (`ssdcache-bench engine`), or nothing if it did not run."""
    e = load_engine(res)
    if not e:
        return []
    out = ["## 5. Engine core (issue 11)", ""]
    w = out.append
    w("The engine alone through its API (`ssdcache-bench engine`: no NBD, no cleaner, one request at a "
      f"time unless said otherwise), replacement policy {e['policy']}, on this machine's {e['cpus']} CPUs.")
    w("")
    if e["admit"]:
        w("### Admitting a write: free slots against every line dirty")
        w("")
        w(f"A write-back cache on a sparse file (O_DIRECT) in front of a sparse backing file twice its size. "
          f"{e['writes']:,} single 4 KiB non-zero writes to lines not in the cache, one at a time: first into "
          "the empty cache (**free** slots), then, after every line was filled with dirty data, with **all "
          "lines dirty**: such a write finds no clean line to evict and goes to the backing device "
          "(`bytes_written_around_full`, checked). *Engine* is the request's time minus the time spent in "
          "device calls (cache: data and journal writes; backing: the write-around): the map lock, the "
          "replacement policy's victim search, line locks and bookkeeping. µs per request.")
        w("")
        w("The last two columns: one thread's cache hits (4 KiB reads of dirty lines) alone, and while another "
          "thread writes into the all-dirty cache: a hit waits for the map lock that such a write holds "
          "(on this machine's one virtio disk the two also share the device).")
        w("")
        w("| cache | lines | free mean | free p99 | free engine | all dirty mean | p50 | p99 | "
          "engine | backing write | fill (s) | hit p99 alone | hit p99 / max beside |")
        w("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in e["admit"]:
            f, d = r["free"], r["all_dirty"]
            limit = r.get("dirty_limit", 1.0)
            cache = f"{fsize(r['cache_size'])} ({r['line_size'] >> 10} KiB lines"
            cache += ")" if limit >= 1 else f", dirty limit {limit:.0%}: the rest clean)"
            w(f"| {cache} | {r['lines']:,} | "
              f"{f['latency']['mean_us']:,.1f} | {f['latency']['p99_us']:,.1f} | {f['breakdown']['engine_us']:,.1f} | "
              f"**{d['latency']['mean_us']:,.1f}** | {d['latency']['p50_us']:,.1f} | {d['latency']['p99_us']:,.1f} | "
              f"**{d['breakdown']['engine_us']:,.1f}** | {d['breakdown']['backing_device_us']:,.1f} | "
              f"{r['fill_secs']:,.1f} | {beside(r)}")
        w("")
    h = e.get("hits")
    if h:
        w("### Cache-hit reads by thread count")
        w("")
        w(f"An in-memory cache ({fsize(h['cache_size'])}, {h['line_size'] >> 10} KiB lines, every line cached, "
          f"on a striped memory device with a lock per 64 KiB, memory backing); T threads each read random 4 KiB blocks for {e['seconds']:g} s; every read is "
          f"checked to be a hit by the volume's counters. The machine has {h['cpus']} CPUs: more threads than "
          "that only show what contention costs.")
        w("")
        hc = e.get("hits_cutoff")
        if hc:
            w(f"The volume's sequential cutoff is off in the first columns; the last two are a second run with "
              f"it at {hc['sequential_cutoff'] >> 20} MiB, the default of served volumes: every hit then also "
              "takes the stream detector's lock of its 256 MiB region, and the benchmark's hits all fall in one region "
              "(docs/design.md, \"Hit path concurrency\").")
            w("")
            w("| threads | requests/s | per thread | µs per request (one thread's view) | requests/s, cutoff on | × cutoff off |")
            w("|---:|---:|---:|---:|---:|---:|")
        else:
            w("| threads | requests/s | per thread | µs per request (one thread's view) |")
            w("|---:|---:|---:|---:|")
        with_cutoff = {r["threads"]: r for r in hc["runs"]} if hc else {}
        for r in h["runs"]:
            note = " (more threads than CPUs)" if r["oversubscribed"] else ""
            row = (f"| {r['threads']}{note} | {r['requests_per_sec']:,.0f} | {r['per_thread_per_sec']:,.0f} | "
                   f"{r['mean_us']:.2f} |")
            if hc:
                c = with_cutoff.get(r["threads"])
                row += (f" {c['requests_per_sec']:,.0f} | {c['requests_per_sec'] / r['requests_per_sec']:.2f} |"
                        if c else " — | — |")
            w(row)
        w("")
    if e["metadata"]:
        w("### Metadata held in RAM")
        w("")
        w("Heap bytes the engine holds for a cache with every line dirty: live heap after the fill minus "
          "before the format, counted by the benchmark's global allocator (map, per-slot arrays, policy, "
          "dirty index, journal buffers). Fixed costs are included, so small caches overstate the per-line "
          "figure. Issue 11's target: at most 0.1% of the cache size at 64 KiB lines. *Checksums in RAM*: "
          "the part of the heap that is metadata pages of data checksums (`serve --checksum-memory`, default "
          "0.01% of the cache, at least 1 MiB; the other pages are on the cache device).")
        w("")
        w("| cache | line size | lines | heap | bytes per line | % of cache | checksums in RAM | peak heap | VmHWM |")
        w("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in e["metadata"]:
            w(f"| {fsize(r['cache_size'])} | {r['line_size'] >> 10} KiB | {r['lines']:,} | "
              f"{r['heap_bytes'] / 1048576:,.1f} MiB | **{r['bytes_per_line']:.1f}** | "
              f"**{r['percent_of_cache']:.3f}%** | {r.get('checksum_bytes', 0) / 1048576:,.1f} MiB | "
              f"{r['heap_peak_bytes'] / 1048576:,.1f} MiB | {r['vmhwm_kib'] / 1024:,.1f} MiB |")
        w("")
    out.extend(volumes_section(e.get("volumes")))
    return out


def volumes_section(v):
    """Four volumes on one cache against the same cache in four partitions (issue 12)."""
    if not v:
        return []
    out = []
    w = out.append
    n = v["volumes"]
    w(f"### {n} volumes on one cache against {n} partitions (issue 12)")
    w("")
    w(f"{n} {v['mode']} volumes of {fsize(v['volume_size'])} each on memory backings, replacement policy "
      f"{v['policy']}, admission {v['admission']}, sequential cutoff {v['sequential_cutoff'] >> 20} MiB "
      "(`ssdcache create`'s defaults). **Shared**: one in-memory cache of "
      f"{fsize(v['cache_size'])} ({v['shared_lines']:,} lines of {v['line_size'] >> 10} KiB) holds all "
      f"{n} volumes, as `ssdcache volume add` makes it. **Partitioned**: {n} caches of "
      f"{v['partition_lines']:,} lines each ({fsize(v['partition_size'])}: a quarter of the lines, each "
      "small cache keeping its own metadata and journal), one volume each, as one cache per disk "
      "would be. Both get the same sequence of 4 KiB reads (seed "
      f"{v['seed']}): {v['hot_share']:.0%} go to the hot volume, uniformly over its first "
      f"{v['hot_set_lines']:,} lines ({v['hot_set_of_shared']:.0%} of the shared cache, "
      f"{v['hot_set_of_partition']:.1f}× a partition); the rest are spread evenly over the other "
      f"{n - 1} volumes, uniformly over each whole volume (little reuse). Phase 1: v0 hot; phase 2: v1 "
      "hot and v0 cold, the caches as phase 1 left them. Each phase: "
      f"{v['warmup_requests']:,} warm-up requests, then {v['measured_requests']:,} measured; read hit "
      "ratios from the engine's own counters (`reads`, `read_hits`). *Hot ratio*: the hot volume's "
      "hit ratio shared over partitioned. *Warm-up*: the hot volume's hit ratio during the warm-up "
      "(in phase 2: how fast each setup follows the new hot volume). *Lines held*: the shared "
      "cache's lines of the hot volume and of the cold ones after the phase.")
    w("")
    w("| phase, hot volume | hot: shared | hot: partitioned | hot ratio | cold volumes | cold: shared | "
      "cold: partitioned | overall: shared | overall: partitioned | overall ratio | "
      "warm-up hot: shared / partitioned | lines held (shared): hot / cold |")
    w("|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for i, p in enumerate(v["phases"], 1):
        sh, pa = p["shared"], p["partitioned"]
        hot = sh["volumes"][p["hot"]]

        def cold(setup):
            return " / ".join(f"{c['hit_ratio']:.3f}" for c in setup["volumes"] if not c["hot"])

        cold_lines = " + ".join(f"{c['lines_used']:,}" for c in sh["volumes"] if not c["hot"])
        cold_names = ", ".join(c["name"] for c in sh["volumes"] if not c["hot"])
        w(f"| {i}, {hot['name']} | {hot['hit_ratio']:.3f} | {pa['volumes'][p['hot']]['hit_ratio']:.3f} | "
          f"**{p['hot_ratio']:.2f}×** | {cold_names} | {cold(sh)} | {cold(pa)} | {sh['overall_hit_ratio']:.3f} | "
          f"{pa['overall_hit_ratio']:.3f} | {p['overall_ratio']:.2f}× | "
          f"{sh['warmup_hot_hit_ratio']:.3f} / {pa['warmup_hot_hit_ratio']:.3f} | "
          f"{hot['lines_used']:,} / {cold_lines} |")
    w("")
    return out


def engine_summary(res):
    e = load_engine(res)
    if not e:
        return
    for r in e["admit"]:
        print(f"engine admit {fsize(r['cache_size'])}: free {r['free']['latency']['mean_us']:.1f} us, "
              f"all dirty {r['all_dirty']['latency']['mean_us']:.1f} us "
              f"(engine {r['all_dirty']['breakdown']['engine_us']:.1f} us)")
    for key, label in (("hits", "engine hits"), ("hits_cutoff", "engine hits, cutoff on")):
        if e.get(key):
            print(f"{label}: " + ", ".join(f"{r['threads']} threads {r['requests_per_sec']:,.0f}/s"
                                          for r in e[key]["runs"]))
    for r in e["metadata"]:
        print(f"engine metadata {fsize(r['cache_size'])} / {r['line_size'] >> 10} KiB lines: "
              f"{r['bytes_per_line']:.1f} B/line, {r['percent_of_cache']:.3f}% of the cache")
    v = e.get("volumes")
    for i, p in enumerate(v["phases"] if v else [], 1):
        print(f"engine volumes phase {i} (hot {p['shared']['volumes'][p['hot']]['name']}): hot hit ratio "
              f"shared {p['shared']['volumes'][p['hot']]['hit_ratio']:.3f}, partitioned "
              f"{p['partitioned']['volumes'][p['hot']]['hit_ratio']:.3f}, {p['hot_ratio']:.2f}x")


def main():
    args = sys.argv[1:]
    if args[0] == "--summary":
        summary(args[1])
        if os.path.isdir(os.path.join(args[1], "hdd")):
            hddreport.summary(args[1])
        if os.path.isdir(os.path.join(args[1], "wb")):
            wbreport.summary(args[1])
        engine_summary(args[1])
        return
    if args[0] == "--compare-summary":
        if os.path.isdir(os.path.join(args[2], "hdd")):
            hddreport.compare_summary(args[1], args[2])
        wbreport.compare_summary(args[1], args[2])
        return
    plots, compare = None, None
    while args and args[0].startswith("--"):
        if args[0] == "--plots":
            plots = args[1]
        elif args[0] == "--compare":
            compare = args[1]
        else:
            sys.exit(f"report.py: unknown option {args[0]}")
        args = args[2:]
    res = args[0]
    analysis = args[1] if len(args) > 1 else None
    env = json.load(open(os.path.join(res, "env.json")))
    keys, runs, med = load(res)
    out = []
    w = out.append

    quick = env["quick"]
    w("# Benchmarks")
    w("")
    if quick:
        w("**Smoke run (`bench/run --quick`): short, single round, a subset of the cells; not for comparison.**")
        w("")
    w(f"Generated by one run of `bench/run{' --quick' if quick else ''}` on {env['date']}. "
      "Regenerate with `bench/run` (about 30 minutes; `bench/run --quick` is the CI smoke version "
      "and writes to `target/bench-quick/BENCHMARKS.md`). Numbers are from this one run on a shared "
      "virtual machine with 2 vCPUs; see the run-to-run comparison for how much they move.")
    w("")
    w("## Machine")
    w("")
    w(f"* {env['nproc']} CPUs ({env['cpu']}), {env['mem']} RAM, kernel {env['kernel']}")
    w(f"* scratch files on {env['fs']}")
    w(f"* load average at start / end: {env['load_start']} / {env['load_end']} "
      "(other work on the machine shares the 2 CPUs and the disk)")
    rerun = env.get("wb_rerun")
    if rerun:
        w(f"* section 3 comes from a separate run (`bench/run --only wb`, {rerun['date']}, ssdcache "
          f"{rerun['ssdcache']}, load average {rerun['load_start']} / {rerun['load_end']}): see its findings")
    w("")
    w("Versions: " + ", ".join([
        f"ssdcache {env['ssdcache']}", env["nbdkit"], env["fio"], env["rustc"]]
        + ([env["libnbd"]] if env.get("libnbd") else [])))
    w("")
    if env.get("hdd"):
        out.extend(hddreport.section(res, env, med.get(APPLES) and med.get("ssdcache") and
                                     (med["ssdcache"]["iops"], med[APPLES]["iops"]), plots, compare))
        # --compare OLD,NEW: compare two other result folders (e.g. two runs of the same build)
    else:
        w("## 1. The cache in front of a hard drive (HDD model)")
        w("")
        w("Not run (`bench/run --only`).")
        w("")
    if not keys:
        w("## 2. Cache-hit reads")
        w("")
        w("Not run (`bench/run --only`).")
        w("")
    else:
        w("## 2. Cache-hit reads (100% hits, the previous benchmark)")
        w("")
    hit_start = len(out)
    w("### Workload")
    w("")
    w(f"4 KiB random reads (`fio --rw=randread --bs={env['bs']} --iodepth={env['iodepth']} --numjobs=1`, "
      f"time based: {env['ramp']} s ramp, {env['runtime']} s measured) over a "
      f"{env['working_set_mib'] // 1024} GiB working set, "
      f"{env['rounds']} round{'s' if env['rounds'] != 1 else ''}: every target runs once per round, the rounds are "
      "interleaved in time, and the table shows each target's median round (by IOPS). NBD targets are reached "
      "with fio's `nbd` engine (libnbd, one connection) over a Unix socket.")
    w("")
    if env.get("sequential_cutoff_flag"):
        w("This cache is created with `--sequential-cutoff 0`: the section measures the hit path, and its "
          "warm-up is one sequential pass, which the stream detector (default 4 MiB) would otherwise keep "
          "out of the cache.")
        w("")
    w(f"* **ssdcache**: a {env['cache_mib'] // 1024} GiB cache file in front of a 2 GiB backing file "
      f"(data over the first {env['working_set_mib'] // 1024} GiB), `create --mode write-through`, 64 KiB lines. "
      "After each start the working set is read once sequentially through NBD (fills the cache the first time; "
      "after a clean stop the restart is warm). The measured phase must be ≥ 99% hits "
      "(`ssdcache stats --json` counters before/after), else `bench/run` fails. ssdcache reads its cache with O_DIRECT.")
    w(f"* **nbdkit file cache=none**: `nbdkit file` serving the same cache file, same {env['working_set_mib'] // 1024} GiB "
      f"region (the cache's data area, from byte {env['data_offset']}). nbdkit 1.32's file plugin has no O_DIRECT "
      "option; `cache=none` reads through the page cache and evicts what it read, so every read reaches the disk, "
      "as ssdcache's do. **This is the apples-to-apples comparison** and the reference of the target.")
    w("* **nbdkit file cache=default (page cache)**: the same, with the region read into the page cache "
      "beforehand: no disk I/O at all (a page-cache lookup per read), not a like-for-like comparison.")
    w("* **nbdkit memory**: nbdkit's `memory` plugin, the working set written into it once: the same client "
      "and socket with no disk and no file behind it, the NBD transport's ceiling on this machine (issue 11's "
      "reference).")
    w("* **ssdcache through nbdkit's nbd plugin, plaintext / TLS** (issue 13): fio's nbd engine cannot "
      "load TLS certificates, so both rows reach ssdcache (`serve --tls on`, x509 made with openssl) through "
      "the same client-side proxy, `nbdkit nbd tls=off|require`: their ratio is what TLS costs on the hit "
      "path; the proxy's own cost is in both.")
    w("* **fio direct**: fio on the cache file itself, `--ioengine=io_uring --direct=1`, same region: "
      "the device's limit with no NBD in between.")
    w("")
    w("### Results")
    w("")
    ref = med.get(APPLES)
    ceil = med.get(CEILING)
    dev = med.get(DEVICE)
    w("| target | IOPS | MB/s | p50 µs | p99 µs | p99.9 µs | server CPU s / M req | "
      "× nbdkit file cache=none | × nbdkit memory | × fio direct |")
    w("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for k in keys:
        m = med[k]
        cpu = fmt(m["server_cpu_s_per_m"], 1)
        if m["server_cpu_s_per_m"] is None:
            cpu = f"— (no server; fio itself: {fmt(m['fio_cpu_s_per_m'], 1)})"
        label = f"**{m['label']}**" if k == "ssdcache" else m["label"]
        cells = [label, f"{m['iops']:,.0f}", f"{m['mbs']:.1f}", f"{m['p50']:,.0f}", f"{m['p99']:,.0f}",
                 f"{m['p999']:,.0f}", cpu]
        for r in (ref, ceil, dev):
            cells.append(f"{ratio(m['iops'], r['iops']):.2f}" if r else "—")
        w("| " + " | ".join(cells) + " |")
    w("")
    w("Latencies are fio completion latencies (`clat`) at the client. *Server CPU s / M req* is the "
      "server process's utime+stime (all threads, from `/proc/PID/stat`) sampled inside the measured "
      "phase, divided by the requests completed in the same time; the fio client's own CPU is not "
      "included (for the fio-direct row it is fio's usr+sys from its JSON output).")
    w("")
    w("Per-round IOPS (chronological), with the server's CPU use (1.0 = one full CPU), how busy the whole "
      f"machine was ({env['nproc']} CPUs: this fio, this server and anything else running) and, for ssdcache, "
      "the hit ratio of the measured phase:")
    w("")
    for k in keys:
        rounds = sorted(runs[k], key=lambda r: r["round"])
        parts = []
        for r in rounds:
            s = f"{r['iops']:,.0f}"
            notes = []
            if r["server_cpu_util"] is not None:
                notes.append(f"server CPU {r['server_cpu_util']:.2f}")
            if r.get("machine_busy") is not None:
                notes.append(f"machine {r['machine_busy'] * 100:.0f}% busy")
            if "hit_ratio" in r:
                notes.append(f"hits {r['hit_ratio'] * 100:.2f}% of {r['reads']:,} reads")
            if notes:
                s += " (" + ", ".join(notes) + ")"
            parts.append(s)
        w(f"* {rounds[0]['label']}: " + "; ".join(parts))
    w("")

    ss = med.get("ssdcache")
    if not keys:
        ss = None
    if keys:
        w("### Target")
        w("")
    if ss and ref:
        r = ratio(ss["iops"], ref["iops"])
        verdict = "**met**" if r >= 1.0 else "**not met**"
        w(f"Target \"ssdcache ≥ 1.0× `nbdkit file`\" (apples-to-apples: cache=none): {verdict}, "
          f"measured **{r:.2f}×** ({ss['iops']:,.0f} vs {ref['iops']:,.0f} IOPS, median rounds).")
        extra_key = next((k for k in med if k.startswith("ssdcache-t")), None)
        extra = med.get(extra_key) if extra_key else None
        facts = []
        if extra:
            facts.append(f"with `--threads {extra_key[len('ssdcache-t'):]}` ssdcache measures "
                         f"{ratio(extra['iops'], ref['iops']):.2f}×")
        lru = med.get("ssdcache-lru")
        if lru:
            facts.append(f"the default replacement policy serves hits at {ratio(ss['iops'], lru['iops']):.2f}× "
                         f"the IOPS of LRU, the cheapest policy per hit, with "
                         f"{fmt(ss['server_cpu_s_per_m'], 1)} vs {fmt(lru['server_cpu_s_per_m'], 1)} server CPU s "
                         "per M requests (the policy's cost per request)")
        if ss["server_cpu_s_per_m"] and ref["server_cpu_s_per_m"]:
            facts.append(f"server CPU per request is {ratio(ss['server_cpu_s_per_m'], ref['server_cpu_s_per_m']):.2f}× "
                         f"nbdkit's ({ss['server_cpu_s_per_m']:.1f} vs {ref['server_cpu_s_per_m']:.1f} s per M requests)")
        small = med.get("ssdcache-crc128k")
        if small:
            facts.append(f"with an eighth of the checksum pages in RAM (`--checksum-memory 128KiB`; most hits "
                         f"read a 4 KiB metadata page from the SSD first) hits run at "
                         f"{ratio(small['iops'], ss['iops']):.2f}× the default's IOPS, "
                         f"{fmt(small['server_cpu_s_per_m'], 1)} server CPU s per M requests")
        metrics = med.get("ssdcache-metrics")
        if metrics:
            r_m = ratio(metrics["iops"], ss["iops"])
            verdict = "**met**" if r_m >= 0.97 else "**not met**"
            facts.append(f"with `--metrics` scraped every second hits run at {r_m:.2f}× the default's IOPS "
                         f"(issue 12: within 3%: {verdict}), {fmt(metrics['server_cpu_s_per_m'], 1)} vs "
                         f"{fmt(ss['server_cpu_s_per_m'], 1)} server CPU s per M requests")
        plain, tls = med.get("ssdcache-proxy"), med.get("ssdcache-proxy-tls")
        if plain and tls:
            facts.append(f"TLS on against off (through the same nbdkit nbd proxy) runs at "
                         f"{ratio(tls['iops'], plain['iops']):.2f}× the IOPS, "
                         f"{fmt(tls['server_cpu_s_per_m'], 1)} vs {fmt(plain['server_cpu_s_per_m'], 1)} "
                         f"server CPU s per M requests")
        page = med.get(PAGE_CACHE)
        if page:
            facts.append(f"against nbdkit serving the file from the page cache ssdcache is at "
                         f"{ratio(ss['iops'], page['iops']):.2f}×")
        if dev:
            facts.append(f"and at {ratio(ss['iops'], dev['iops']):.2f}× of fio directly on the file")
        if facts:
            w("")
            w("In this run " + "; ".join(facts) + ".")
        issue11_hit_targets(w, ss, ceil, dev)
        by_round = {x["round"]: x["iops"] for x in runs[APPLES]}
        pairs = [(x["iops"], by_round[x["round"]]) for x in runs["ssdcache"] if x["round"] in by_round]
        if len(pairs) > 1:
            wins = sum(1 for a, b in pairs if a >= b)
            lo = min(a / b for a, b in pairs)
            hi = max(a / b for a, b in pairs)
            w("")
            w(f"Round by round (each ssdcache run against the nbdkit cache=none run of the same round) "
              f"ssdcache was ahead in {wins} of {len(pairs)} rounds, ratios {lo:.2f}× to {hi:.2f}×.")
        w("")
        if r < 1.0:
            w("Why, and what would close the gap: see *Findings* below.")
        else:
            w("Where ssdcache trails (single rounds), why, and the headroom left (transport ceiling, "
              "fio direct): see *Findings* below.")
    elif keys:
        w("Not evaluated (a target is missing from this run).")
    w("")
    w("### Memory")
    w("")
    if ss:
        cache_gib = env["cache_mib"] / 1024
        hwm = max(r["vmhwm_kib"] for r in runs["ssdcache"])
        rss = ss["vmrss_kib"]
        w(f"ssdcache daemon (serve defaults) after the measured phase: VmRSS {rss / 1024:.1f} MiB, "
          f"VmHWM {hwm / 1024:.1f} MiB (largest over the rounds) for a {cache_gib:g} GiB cache: "
          f"**{rss / 1024 / cache_gib:.1f} MiB resident per GiB of cache** "
          f"(peak {hwm / 1024 / cache_gib:.1f} MiB per GiB). This includes the fixed part "
          "(binary, thread stacks, per-worker buffers), so it overstates the per-GiB cost of small caches.")
        for key in (k for k in runs if k.startswith("ssdcache-t")):
            e = med[key]
            w(f"With `--threads {key[len('ssdcache-t'):]}`: VmRSS {e['vmrss_kib'] / 1024:.1f} MiB.")
    w("")
    if not keys:
        del out[hit_start:]
    commands = open(os.path.join(res, "commands.txt")).read()
    if env.get("wb"):
        out.extend(wbreport.section(res, env, compare))
        commands = wbreport.other_commands(commands)   # section 3 lists its own
    out.extend(simreport.section(res))
    out.extend(engine_section(res))
    out.extend(netreport.section(res))
    w("## Commands")
    w("")
    w("As run by `bench/run` (`$T` is the scratch folder, `.` the repository; RESULT.json is one file per run"
      + ("; section 3's commands are listed in that section" if env.get("wb") else "") + "):")
    w("")
    w("```")
    w(commands.rstrip())
    w("```")
    w("")
    if analysis and os.path.exists(analysis):
        w(open(analysis).read().rstrip())
        w("")
    print("\n".join(out))


if __name__ == "__main__":
    main()
