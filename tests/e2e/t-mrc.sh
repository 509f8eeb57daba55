#!/usr/bin/env bash
# `ssdcache mrc` on shared traces: the exact curve (libCacheSim's LRU point on arc/P3), its CSV
# (columns, 100 sizes, miss ratio never rising with size) and SVG (well-formed XML), --json,
# --csv -, SHARDS with --check printing its measured error, auto falling back to SHARDS past
# --exact-max-lines, a region-sampled ssdcache recording scaled by its rate, and bad input:
# errors that name the file with status 1, usage errors with status 2.
source "$(dirname "$0")/lib.sh"
require_tool python3 jq head
require_bin
TRACES="${SSDCACHE_TRACES:-$REPO/../shared/traces}"
P3="$TRACES/arc/P3.lis.zst"
CLOUD="$TRACES/cloudphysics/cloudPhysicsIO.csv"
for f in "$P3" "$CLOUD"; do
    [[ -f "$f" ]] || fail "shared trace $f is missing (set SSDCACHE_TRACES)"
done

# expect_status STATUS REGEX CMD...: CMD exits with STATUS and its stderr matches REGEX.
expect_status() {
    local want=$1 re=$2 rc=0
    shift 2
    timeout -k 5 60 "$@" >"$TEST_DIR/es.out" 2>"$TEST_DIR/es.err" || rc=$?
    [[ $rc -eq $want ]] || fail "expected status $want, got $rc: $*
stderr: $(cat "$TEST_DIR/es.err")"
    grep -Eq -- "$re" "$TEST_DIR/es.err" || fail "stderr does not match /$re/: $*
stderr: $(cat "$TEST_DIR/es.err")"
    log "status $rc as expected: $(head -c 200 "$TEST_DIR/es.err" | tr '\n' ' ')"
}

# check_csv FILE ROWS: the header, ROWS data rows, sizes rising, miss ratio never rising,
# miss + hit = 1, the last size the whole footprint.
check_csv() {
    python3 - "$1" "$2" <<'EOF'
import csv, sys
path, rows_expected = sys.argv[1], int(sys.argv[2])
with open(path, newline="") as f:
    header = f.readline().strip()
    assert header == "cache_bytes,cache_lines,fraction_of_footprint,miss_ratio,hit_ratio", header
    rows = list(csv.reader(f))
assert len(rows) == rows_expected, f"{len(rows)} rows, expected {rows_expected}"
previous = None
for row in rows:
    assert len(row) == 5, row
    size, lines, fraction, miss, hit = int(row[0]), int(row[1]), float(row[2]), float(row[3]), float(row[4])
    assert lines == size // 4096, row
    assert 0 <= miss <= 1 and abs(miss + hit - 1) < 1e-5, row
    if previous:
        assert size > previous[0], f"sizes not rising: {previous} then {row}"
        assert miss <= previous[1] + 1e-9, f"miss ratio rises: {previous} then {row}"
    previous = (size, miss)
assert abs(float(rows[-1][2]) - 1.0) < 1e-3, rows[-1]
EOF
}

# Exact (auto on a small trace) with every output.
out=$(ssd mrc --trace "$P3" --csv p3.csv --plot p3.svg) || fail "mrc on P3 failed: $out"
log "mrc P3:
$out"
assert_contains "$out" "method     exact" "P3 is computed exactly under auto"
assert_contains "$out" "footprint  102348 unique lines" "P3's footprint (unique 4 KiB blocks)"
assert_contains "$out" "error      none" "the exact curve states no error"
check_csv p3.csv 100 || fail "p3.csv is not a valid curve: $(head -n 3 p3.csv)"
# libCacheSim's LRU on P3 at 10% of the footprint (10,234 blocks) misses 0.7350; row 10 is at
# 10,235 blocks.
miss10=$(sed -n 11p p3.csv | cut -d, -f4)
python3 -c "import sys; m = float(sys.argv[1]); sys.exit(0 if abs(m - 0.7350) < 0.001 else 1)" "$miss10" \
    || fail "P3 at 10%: miss ratio $miss10, libCacheSim 0.7350"
python3 - p3.svg <<'EOF' || fail "p3.svg is not a well-formed SVG chart"
import sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
assert root.tag.endswith("svg"), root.tag
texts = [t.text.strip() for t in root.iter() if t.tag.endswith("text") and t.text]
assert "hit ratio" in texts and "LRU, exact" in texts, texts
EOF

# --json: the same curve.
json=$(ssd mrc --trace "$P3" --json) || fail "mrc --json failed"
assert_eq "$(jq -r .method <<<"$json")" exact "--json method"
assert_eq "$(jq '.points | length' <<<"$json")" 100 "--json points"
assert_eq "$(jq -r '.points[9].miss_ratio' <<<"$json" | cut -c1-5)" "$(cut -c1-5 <<<"$miss10")" "--json and --csv agree"

# --csv -: the CSV alone on standard output, the summary on standard error.
ssd mrc --trace "$P3" --csv - --sizes 1%,10%,1GiB >stdout.csv 2>summary.txt || fail "mrc --csv - failed: $(cat summary.txt)"
assert_eq "$(head -n 1 stdout.csv)" "cache_bytes,cache_lines,fraction_of_footprint,miss_ratio,hit_ratio" "--csv - header"
assert_eq "$(wc -l <stdout.csv)" 4 "--csv - with three sizes"
assert_contains "$(cat summary.txt)" "method     exact" "the summary goes to stderr with --csv -"

# SHARDS at a fixed rate, with --check: the error is stated and measured.
out=$(ssd mrc --trace "$CLOUD" --method shards-rate --check --plot cloud.svg) || fail "mrc shards-rate --check failed: $out"
log "mrc cloudphysics shards-rate --check:
$out"
assert_contains "$out" "SHARDS, fixed rate 0.01" "shards-rate method line"
assert_contains "$out" "expect a mean absolute error of about" "the expected error is stated"
mae=$(grep -Eo 'absolute error of [0-9.]+' <<<"$out" | grep -Eo '[0-9.]+$') || fail "--check printed no MAE: $out"
python3 -c "import sys; sys.exit(0 if 0 < float(sys.argv[1]) < 0.05 else 1)" "$mae" \
    || fail "cloudphysics at 1%: MAE $mae"
python3 -c "import sys, xml.etree.ElementTree as ET; ET.parse(sys.argv[1])" cloud.svg || fail "cloud.svg is not XML"
grep -q "exact (--check)" cloud.svg || fail "the --check plot lacks the exact curve"

# Fixed size, and auto past --exact-max-lines: SHARDS with the error stated.
out=$(ssd mrc --trace "$P3" --method shards-size --max-keys 4096 --check) || fail "shards-size failed: $out"
assert_contains "$out" "sampled    4096 lines" "shards-size samples --max-keys lines"
grep -Eq 'absolute error of 0\.0[0-4]' <<<"$out" || fail "shards-size 4096 on P3: $out"
out=$(ssd mrc --trace "$P3" --exact-max-lines 1000) || fail "auto past the exact limit failed: $out"
assert_contains "$out" "more than --exact-max-lines 1000 unique lines" "auto says why it sampled"
assert_contains "$out" "K = 65536 sampled lines" "auto falls back to fixed-size SHARDS"

# A recording sampled by region: sizes and footprint scaled by 1/rate, its error stated.
{
    echo "# ssdcache-trace v1"
    echo "# sample_rate=0.25 sample_region=1048576"
    echo "# time_us,volume,op,offset,length"
    for ((i = 0; i < 3; i++)); do
        for ((b = 0; b < 64; b++)); do echo "$((i * 100 + b)),sdb,R,$((b * 4096)),4096"; done
    done
} >recorded.trace
json=$(ssd mrc --trace recorded.trace --json) || fail "mrc on a recorded trace failed"
assert_eq "$(jq -r .footprint_bytes <<<"$json")" $((4 * 64 * 4096)) "footprint scaled by 1/rate"
assert_eq "$(jq -r .recording.regions_kept <<<"$json")" 1 "regions in the recording"
out=$(ssd mrc --trace recorded.trace) || fail "mrc on a recorded trace failed"
assert_contains "$out" "scaled by 4" "the text says sizes are scaled"

# Bad input: status 1 and the file named; usage errors: status 2.
expect_status 1 "missing\.trace.*No such file" "$SSDCACHE_BIN" mrc --trace missing.trace
expect_status 1 "P3\.lis\.zst line 1: .*MSR" "$SSDCACHE_BIN" mrc --trace "$P3" --format msr
head -c 100000 "$P3" >cut.lis.zst
expect_status 1 "cut\.lis\.zst: corrupt or truncated zstd" "$SSDCACHE_BIN" mrc --trace cut.lis.zst
{ head -n 50 "$CLOUD"; echo "1,2,0x28,oops,7"; } >corrupt.csv
expect_status 1 "corrupt\.csv line 51" "$SSDCACHE_BIN" mrc --trace corrupt.csv --format vscsi-csv
expect_status 2 "unknown trace format" "$SSDCACHE_BIN" mrc --trace "$P3" --format nosuch
expect_status 2 "both write to standard output" "$SSDCACHE_BIN" mrc --trace "$P3" --json --csv -
expect_status 2 "above 0%" "$SSDCACHE_BIN" mrc --trace "$P3" --sizes 0%
expect_status 2 "power of two" "$SSDCACHE_BIN" mrc --trace "$P3" --line-size 1000
expect_status 2 "sampling rate" "$SSDCACHE_BIN" mrc --trace "$P3" --method shards-rate --sample-rate 2
log "mrc: all checks passed"
