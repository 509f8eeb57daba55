#!/usr/bin/env bash
# simulate and advise on real traces: the libCacheSim reference point of arc/P3 (LRU and ARC
# miss ratios at 10% of the footprint), CSV/JSON/SVG outputs, the write-back byte accounting,
# advise's answer checked against simulate's curve, and the whole loop a user runs: record a
# workload with `serve --record-trace`, then simulate and advise on the recording. Bad input
# gets an error naming the file.
source "$(dirname "$0")/lib.sh"
require_tool qemu-io jq python3 truncate
require_bin
TRACES="$REPO/../shared/traces"
P3="$TRACES/arc/P3.lis.zst"
CP="$TRACES/cloudphysics/cloudPhysicsIO.csv"
[[ -f "$P3" && -f "$CP" ]] || fail "shared traces missing: $TRACES (CI has shared/ beside the checkout)"

log "simulate: libCacheSim's reference point on arc/P3 (10% of the footprint = 10,234 blocks)"
ssd simulate --trace "$P3" --policy lru,arc,s3fifo --cache-size 10% --sequential-cutoff 0 \
    --csv >p3.csv
python3 - p3.csv <<'EOF'
import csv, sys
rows = {r["policy"]: r for r in csv.DictReader(open(sys.argv[1]))}
ref = {"lru": 0.7350, "arc": 0.6210, "s3fifo": 0.5840}   # shared/traces/README.md
for p, miss in ref.items():
    r = rows[p]
    assert int(r["cache_lines"]) == 10234, r
    got = 1 - float(r["hit_ratio"])
    assert abs(got - miss) <= 0.002, f"{p}: miss ratio {got:.4f}, libCacheSim {miss}"
print("P3 reference points match")
EOF

log "simulate: table, JSON and plot"
out=$(ssd simulate --trace "$P3" --policy lru,s3fifo --cache-size 1%,10%,50% --plot p3.svg)
assert_contains "$out" "footprint 399.8 MiB (102348 unique lines)" "simulate table header"
assert_contains "$out" "s3fifo" "simulate table rows"
python3 -c 'import sys, xml.dom.minidom as m; d = m.parse(sys.argv[1]); t = d.toxml(); assert "lru" in t and "s3fifo" in t' p3.svg \
    || fail "p3.svg is not a well-formed SVG naming both policies"
json=$(ssd simulate --trace "$P3" --policy lru --cache-size 10% --json)
assert_eq "$(jq '.rows | length' <<<"$json")" 1 "JSON rows"
assert_eq "$(jq '.summary.requests' <<<"$json")" 238578 "JSON request count of P3"

log "simulate: write-back accounting on the CloudPhysics trace (59% writes)"
ssd simulate --trace "$CP" --policy lru --cache-size 10%,50% --mode write-back \
    --admission always,2-hit --csv >cp.csv
python3 - cp.csv <<'EOF'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
assert len(rows) == 4, rows
for r in rows:
    assert int(r["write_refs"]) > 0 and float(r["write_hit_ratio"]) > 0, r
    assert int(r["backing_bytes_written"]) > 0, r
big = {r["admission"]: r for r in rows if r["cache_bytes"] == max(x["cache_bytes"] for x in rows)}
# 2-hit keeps one-hit wonders off the SSD: fewer cache writes, at some cost in hits.
assert int(big["2-hit"]["cache_bytes_written"]) < int(big["always"]["cache_bytes_written"]), big
assert int(big["2-hit"]["not_admitted_refs"]) > 0 and int(big["always"]["not_admitted_refs"]) == 0, big
print("write-back rows consistent")
EOF

log "advise: the size it names reaches the target in simulate, a smaller one does not"
adv=$(ssd advise --trace "$CP" --target-hit-ratio 0.25 --capacity 4TB --ssd-tbw 600 --json)
size=$(jq -r '.recommended.cache_bytes' <<<"$adv")
[[ "$size" =~ ^[0-9]+$ ]] || fail "advise named no size: $adv"
policy=$(jq -r '.policy' <<<"$adv")
hit=$(ssd simulate --trace "$CP" --policy "$policy" --cache-size "$size" --json | jq '.rows[0].hit_ratio')
python3 -c "import sys; assert float(sys.argv[1]) >= 0.25, sys.argv[1]" "$hit" || fail "simulate at $size gives $hit < 0.25"
python3 - <<EOF || fail "advise's endurance or cost is inconsistent: $adv"
import json
a = json.loads('''$adv''')
e, c = a["endurance"], a["cost"]
assert e["tbw_bytes"] == 600e12 and not e["tbw_assumed"]
assert e["ssd_bytes_written_per_day"] > 0 and e["lifetime_years"] > 0
assert abs(c["all_flash"] - 4 * 60) < 1e-6 and c["hybrid"] < c["all_flash"]
EOF
txt=$(ssd advise --trace "$CP" --target-hit-ratio 0.99)
assert_contains "$txt" "No cache reaches a hit ratio of 0.990" "advise with an unreachable target"

log "record a workload with serve --record-trace, then simulate and advise on it"
mk_sparse backing.img 256M
mk_sparse cache.img 64M
create_cache cache.img backing.img --name vol0 --mode write-through
start_server "$TEST_DIR/nbd.sock" --cache cache.img --record-trace "$TEST_DIR/rec.trace"
URI=$(nbd_uri "$SOCK")
# 64 distinct 4 KiB blocks, each read 3 times: 192 reads, footprint 256 KiB, 128 re-references.
cmds=()
for pass in 1 2 3; do
    for i in $(seq 0 63); do cmds+=(-c "read $((i * 1024 * 1024)) 4k"); done
done
qemu-io -f raw "$URI" "${cmds[@]}" >/dev/null
stop_server
head -1 rec.trace | grep -qx '# ssdcache-trace v1' || fail "rec.trace header: $(head -3 rec.trace)"
json=$(ssd simulate --trace rec.trace --policy lru --cache-size 1MiB --sequential-cutoff 0 --json)
assert_eq "$(jq -r '.format' <<<"$json")" ssdcache "recorded trace format detected"
assert_eq "$(jq '.summary.requests' <<<"$json")" 192 "recorded requests"
assert_eq "$(jq '.summary.unique_lines' <<<"$json")" 64 "recorded footprint in lines"
assert_eq "$(jq '.rows[0].read_refs' <<<"$json")" 192 "line references"
python3 -c "import sys; assert abs(float(sys.argv[1]) - 128/192) < 1e-9, sys.argv[1]" \
    "$(jq '.rows[0].hit_ratio' <<<"$json")" || fail "recorded trace: hit ratio is not 128/192"
adv=$(ssd advise --trace rec.trace --policy lru --target-hit-ratio 0.6 --json)   # a loop: LRU needs every line
assert_eq "$(jq '.recommended.cache_bytes' <<<"$adv")" $((256 * 1024)) "advise (LRU) on the recorded loop: all 64 lines"

log "bad input: errors name the file"
printf 'not,a,trace\n' >bad.csv
expect_fail_stderr "simulate on a file of no known format" 'bad\.csv' "$SSDCACHE_BIN" simulate --trace bad.csv
expect_fail_stderr "simulate with a missing file" 'nonexistent\.trace' "$SSDCACHE_BIN" simulate --trace nonexistent.trace
printf '1 8 0 0\n2 8 0 1\nthree 8 0 2\n' >cut.lis
expect_fail_stderr "arc trace with a bad line" 'cut\.lis.*line 3' "$SSDCACHE_BIN" simulate --trace cut.lis --format arc
expect_fail_stderr "unknown policy" 'unknown policy' "$SSDCACHE_BIN" simulate --trace "$P3" --policy lfu-ish
expect_fail_stderr "bad target" 'above 0 and below 1' "$SSDCACHE_BIN" advise --trace "$P3" --target-hit-ratio 1.5
log "PASS"
