"""Section 6 of BENCHMARKS.md: the cache in front of a backing device over the network
(bench/net.sh's results in RESULTS/net/)."""

import json
import os


def _fio(path):
    """IOPS and p99 completion latency (ms) of a fio JSON result's one job."""
    try:
        job = json.load(open(path))["jobs"][0]
    except (OSError, ValueError, KeyError, IndexError):
        return None
    side = job["read"] if job["read"]["io_bytes"] > 0 else job["write"]
    pct = side.get("clat_ns", {}).get("percentile", {})
    p99 = next((v for k, v in pct.items() if k.startswith("99.000")), None)
    return {"iops": side["iops"], "p99_ms": p99 / 1e6 if p99 else None}


def _ms(v):
    return "–" if v is None else f"{v:.2f} ms"


def section(res):
    d = os.path.join(res, "net")
    try:
        env = json.load(open(os.path.join(d, "env.json")))
    except (OSError, ValueError):
        return []
    out = []
    w = out.append
    w("## 6. In front of networked storage (NBD backing)")
    w("")
    w("The backing device is an NBD export (nbdkit's file plugin with its delay filter adding "
      "the latency in the first column to every read and write, as a network hop to a "
      "distributed store does); ssdcache caches it write-back with `--backing "
      "nbd+unix:///?socket=...`. fio's nbd engine, 4 KiB random requests at QD"
      f"{env['qd']} over a {env['working_set_mib']} MiB working set, {env['runtime']} s each: "
      "on the bare export, and through ssdcache (reads after one warming pass: hits; writes "
      "absorbed by the cache while the cleaner destages to the export).")
    w("")
    w("| added latency | workload | bare export IOPS | ssdcache IOPS | ratio | bare p99 | ssdcache p99 |")
    w("|---|---|---|---|---|---|---|")
    for delay in env["delays"]:
        for kind, label in (("read", "random reads (warm)"), ("write", "random writes (write-back)")):
            bare = _fio(os.path.join(d, f"bare-{kind}-{delay}.json"))
            cached = _fio(os.path.join(d, f"cached-{kind}-{delay}.json"))
            if not bare or not cached:
                continue
            ratio = cached["iops"] / bare["iops"] if bare["iops"] else float("nan")
            w(f"| {delay} | {label} | {bare['iops']:,.0f} | {cached['iops']:,.0f} | "
              f"**{ratio:.1f}×** | {_ms(bare['p99_ms'])} | {_ms(cached['p99_ms'])} |")
    w("")
    w("Not measured yet: ordered write-back against plain write-back (issue 13 item 6 is not "
      "built), and a real distributed store's export in place of the delay filter.")
    w("")
    return out
