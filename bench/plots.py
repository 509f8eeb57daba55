#!/usr/bin/env python3
"""SVG plots for BENCHMARKS.md, from a results folder of bench/run (no plotting library).

    plots.py RESULTS_DIR OUT_DIR   -> OUT_DIR/warmup.svg, OUT_DIR/latency-cdf.svg

warmup.svg: the cold database model on ssdcache write-through: IOPS per second (fio's IOPS
log) and the read hit ratio per second (deltas of `ssdcache stats --json` sampled every
second), with the raw HDD model's IOPS on the same workload for reference.
latency-cdf.svg: read completion latency percentiles (fio clat) of the warm database model,
working set inside the cache, one line per target (log scale).
"""
import glob
import json
import math
import os
import sys

COLORS = {
    "hdd": "#555555",
    "nbdkit": "#d95f02",
    "ssd-wt": "#1b9e77",
    "ssd-wb": "#66a61e",
    "ssd-wa": "#7570b3",
    "ssd-pt": "#e7298a",
}
LABELS = {
    "hdd": "raw HDD model",
    "nbdkit": "nbdkit --filter=cache",
    "ssd-wt": "ssdcache write-through",
    "ssd-wb": "ssdcache write-back",
    "ssd-wa": "ssdcache write-around",
    "ssd-pt": "ssdcache pass-through",
}
W, H = 760, 420
L, R, TOP, B = 70, 70, 40, 60


def esc(s):
    return str(s).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


class Svg:
    def __init__(self, title):
        self.parts = [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" '
            'font-family="sans-serif" font-size="12">',
            f'<rect width="{W}" height="{H}" fill="white"/>',
            f'<text x="{W / 2}" y="22" text-anchor="middle" font-size="14" font-weight="bold">{esc(title)}</text>',
        ]

    def add(self, s):
        self.parts.append(s)

    def line(self, x1, y1, x2, y2, color="#000", width=1, dash=None):
        d = f' stroke-dasharray="{dash}"' if dash else ""
        self.add(f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" stroke="{color}" '
                 f'stroke-width="{width}"{d}/>')

    def text(self, x, y, s, anchor="middle", color="#000", rotate=None, size=12):
        t = f' transform="rotate({rotate} {x:.1f} {y:.1f})"' if rotate is not None else ""
        self.add(f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" fill="{color}" font-size="{size}"{t}>'
                 f'{esc(s)}</text>')

    def poly(self, pts, color, width=2, dash=None):
        if not pts:
            return
        d = f' stroke-dasharray="{dash}"' if dash else ""
        p = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
        self.add(f'<polyline points="{p}" fill="none" stroke="{color}" stroke-width="{width}"{d}/>')

    def save(self, path):
        self.parts.append("</svg>")
        with open(path, "w") as f:
            f.write("\n".join(self.parts) + "\n")


def nice_max(v):
    if v <= 0:
        return 1
    e = 10 ** math.floor(math.log10(v))
    for m in (1, 2, 2.5, 5, 10):
        if v <= m * e:
            return m * e
    return 10 * e


def fio_job(path):
    return json.load(open(path))["jobs"][0]


def warmup_plot(hres, out):
    logs = sorted(glob.glob(os.path.join(hres, "curve_iops*.log")))
    if not logs:
        return False
    per_sec = {}
    for lp in logs:
        for line in open(lp):
            f = [x.strip() for x in line.split(",")]
            if len(f) < 2:
                continue
            t = round(int(f[0]) / 1000)
            per_sec[t] = per_sec.get(t, 0) + int(f[1])
    iops = sorted(per_sec.items())
    # Hit ratio per interval between consecutive stats samples.
    start = float(open(os.path.join(hres, "curve.start")).read())
    samples = []
    for line in open(os.path.join(hres, "curve.stats.jsonl")):
        ts, _, js = line.partition(" ")
        try:
            v = json.loads(js)["volumes"][0]
        except (ValueError, KeyError, IndexError):
            continue
        samples.append((float(ts) - start, v["reads"], v["read_hits"]))
    hits = []
    for (t0, r0, h0), (t1, r1, h1) in zip(samples, samples[1:]):
        if r1 > r0:
            hits.append(((t0 + t1) / 2, 100.0 * (h1 - h0) / (r1 - r0)))
    hdd_ref = None
    p = os.path.join(hres, "hdd.db.in.any.fio.json")
    if os.path.exists(p):
        j = fio_job(p)
        hdd_ref = j["read"]["iops"] + j["write"]["iops"]

    tmax = max([t for t, _ in iops] + [t for t, _ in hits] + [1])
    ymax = nice_max(max([v for _, v in iops] + [hdd_ref or 0, 1]) * 1.1)
    pw, ph = W - L - R, H - TOP - B
    X = lambda t: L + pw * t / tmax
    Y = lambda v: TOP + ph * (1 - v / ymax)
    Yh = lambda p: TOP + ph * (1 - p / 100)
    s = Svg("Warm-up: cold database model (randrw 75/25, 4 KiB, QD64) on ssdcache write-through")
    for i in range(6):
        v = ymax * i / 5
        s.line(L, Y(v), L + pw, Y(v), "#e0e0e0")
        s.text(L - 6, Y(v) + 4, f"{v:,.0f}", anchor="end")
        s.text(L + pw + 6, Yh(100 * i / 5) + 4, f"{100 * i / 5:.0f}%", anchor="start", color="#1f78b4")
    for i in range(6):
        t = tmax * i / 5
        s.text(X(t), TOP + ph + 18, f"{t:.0f}")
    s.line(L, TOP, L, TOP + ph)
    s.line(L, TOP + ph, L + pw, TOP + ph)
    s.line(L + pw, TOP, L + pw, TOP + ph, "#1f78b4")
    s.text(L + pw / 2, H - 22, "seconds since the start (cold cache)")
    s.text(18, TOP + ph / 2, "IOPS (reads + writes, 1 s averages)", rotate=-90)
    s.text(W - 14, TOP + ph / 2, "read hit ratio per second", rotate=90, color="#1f78b4")
    s.poly([(X(t), Y(v)) for t, v in iops], COLORS["ssd-wt"])
    s.poly([(X(t), Yh(p)) for t, p in hits], "#1f78b4", dash="5,3")
    if hdd_ref:
        s.line(L, Y(hdd_ref), L + pw, Y(hdd_ref), COLORS["hdd"], 1.5, "2,3")
    lx, ly = L + 12, TOP + 14
    for color, label, dash in ((COLORS["ssd-wt"], "IOPS (fio --write_iops_log)", None),
                               ("#1f78b4", "read hit ratio (ssdcache stats --json)", "5,3"),
                               (COLORS["hdd"], f"raw HDD model, same workload ({hdd_ref or 0:,.0f} IOPS)", "2,3")):
        s.line(lx, ly - 4, lx + 24, ly - 4, color, 2, dash)
        s.text(lx + 30, ly, label, anchor="start")
        ly += 16
    s.save(out)
    return True


def cdf_plot(hres, out):
    series = []
    for t in ("hdd", "nbdkit", "ssd-wt", "ssd-wb", "ssd-wa", "ssd-pt"):
        for state in ("warm", "any"):
            p = os.path.join(hres, f"{t}.db.in.{state}.fio.json")
            if os.path.exists(p):
                pct = fio_job(p)["read"]["clat_ns"].get("percentile", {})
                pts = sorted((float(k), v / 1000) for k, v in pct.items() if v > 0)
                if pts:
                    series.append((t, pts))
                break
    if not series:
        return False
    lo = min(v for _, pts in series for _, v in pts)
    hi = max(v for _, pts in series for _, v in pts)
    lo_e, hi_e = math.floor(math.log10(max(lo, 1))), math.ceil(math.log10(hi))
    if hi_e == lo_e:
        hi_e += 1
    pw, ph = W - L - R + 40, H - TOP - B
    X = lambda us: L + pw * (math.log10(max(us, 10 ** lo_e)) - lo_e) / (hi_e - lo_e)
    Y = lambda p: TOP + ph * (1 - p / 100)
    s = Svg("Read latency CDF: warm database model, working set inside the cache")
    for i in range(6):
        p = 20 * i
        s.line(L, Y(p), L + pw, Y(p), "#e0e0e0")
        s.text(L - 6, Y(p) + 4, f"{p}%", anchor="end")
    for e in range(lo_e, hi_e + 1):
        s.line(X(10 ** e), TOP, X(10 ** e), TOP + ph, "#e0e0e0")
        us = 10 ** e
        s.text(X(us), TOP + ph + 18, f"{us / 1000:g} ms" if us >= 1000 else f"{us} µs")
    s.line(L, TOP, L, TOP + ph)
    s.line(L, TOP + ph, L + pw, TOP + ph)
    s.text(L + pw / 2, H - 22, "read completion latency (fio clat, log scale)")
    s.text(18, TOP + ph / 2, "fraction of reads at or below", rotate=-90)
    ly = TOP + ph - 16 * len(series)
    for t, pts in series:
        s.poly([(X(v), Y(p)) for p, v in pts], COLORS[t])
        s.line(L + pw - 200, ly - 4, L + pw - 176, ly - 4, COLORS[t], 2)
        s.text(L + pw - 170, ly, LABELS[t], anchor="start")
        ly += 16
    s.save(out)
    return True


def main():
    res, outdir = sys.argv[1], sys.argv[2]
    hres = os.path.join(res, "hdd")
    os.makedirs(outdir, exist_ok=True)
    made = []
    if warmup_plot(hres, os.path.join(outdir, "warmup.svg")):
        made.append("warmup.svg")
    if cdf_plot(hres, os.path.join(outdir, "latency-cdf.svg")):
        made.append("latency-cdf.svg")
    print("plots: " + ", ".join(made), file=sys.stderr)


if __name__ == "__main__":
    main()
