#!/usr/bin/env python3
"""DiskSim ASCII trace -> fio iolog (version 2), for `fio --read_iolog=FILE --replay_no_stall=1`.

    trace2iolog.py TRACE [--requests N] [--region BYTES] --out FILE [--summary JSON]

Input lines: `time_ns device start_sector nsectors type` (512-byte sectors; type 1 = read,
0 = write), e.g. mqsim/*.trace of the shared traces or phases.disksim of
`bench/libcachesim/synthetic traces DIR`. The first N requests are kept (all
devices, in order). Byte offsets are aligned down to 4 KiB and folded into [0, REGION)
(offset modulo REGION: the trace addresses a far larger disk than the benchmark's); lengths
are rounded up to 4 KiB and clipped at the end of the region. Timing is dropped (the replay
issues requests as fast as the queue depth allows).
"""
import argparse
import json

p = argparse.ArgumentParser()
p.add_argument("trace")
p.add_argument("--requests", type=int, default=2000)
p.add_argument("--region", type=int, required=True)
p.add_argument("--out", required=True)
p.add_argument("--summary")
p.add_argument("--file", default="nbd", help="file name in the iolog (fio's nbd engine ignores it)")
a = p.parse_args()

A = 4096
region = a.region // A * A
ops = []
with open(a.trace) as f:
    for line in f:
        parts = line.split()
        if len(parts) < 5:
            continue
        _t, _dev, sector, nsect, typ = parts[:5]
        off = int(sector) * 512
        end = off + max(int(nsect), 1) * 512
        start = off // A * A
        length = (end - start + A - 1) // A * A
        start %= region
        length = min(length, region - start)
        ops.append(("read" if typ == "1" else "write", start, length))
        if len(ops) >= a.requests:
            break

with open(a.out, "w") as f:
    f.write("fio version 2 iolog\n")
    f.write(f"{a.file} add\n{a.file} open\n")
    for op, off, ln in ops:
        f.write(f"{a.file} {op} {off} {ln}\n")
    f.write(f"{a.file} close\n")

if a.summary:
    reads = [o for o in ops if o[0] == "read"]
    distinct = len({o[1] // 65536 for o in ops})
    json.dump(dict(trace=a.trace, requests=len(ops), reads=len(reads), writes=len(ops) - len(reads),
                   bytes=sum(o[2] for o in ops), region=region,
                   distinct_64k_lines=distinct,
                   mean_kib=sum(o[2] for o in ops) / len(ops) / 1024 if ops else 0),
              open(a.summary, "w"))
