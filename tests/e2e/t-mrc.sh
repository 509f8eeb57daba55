#!/usr/bin/env bash
# `ssdcache mrc` on traces: the exact curve (libCacheSim's LRU at 10% of the footprint), its
# CSV (columns, 100 sizes, miss ratio never rising with size) and SVG (well-formed XML),
# --json, --csv -, SHARDS with --check printing its measured error, auto falling back to SHARDS
# past --exact-max-lines, a region-sampled ssdcache recording scaled by its rate, and bad
# input: errors that name the file with status 1, usage errors with status 2. The trace checks
# run on the synthetic traces of bench/libcachesim/synthetic (skewed.lis compressed with zstd,
# phases.csv; libCacheSim's values from its synthetic.csv) and, when SSDCACHE_TRACES names the
# shared traces folder, on arc/P3 and the CloudPhysics csv too.
source "$(dirname "$0")/lib.sh"
require_tool python3 jq head zstd
require_bin

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


# mrc_checks LABEL READS SPEC SAMPLED CSV
#   READS    a zstd-compressed ARC trace; SPEC "lines=N unique=N lru=M": its unique lines, and
#            libCacheSim's LRU miss ratio at N lines, 10% of them
#   SAMPLED  a trace large enough for SHARDS at 1% to be within 0.05
#   CSV      a vscsi csv trace (a line of it is corrupted)
mrc_checks() {
    local label=$1 reads=$2 spec=$3 sampled=$4 csv=$5
    local unique lines lru out miss10 json mae name
    unique=$(spec_get "$spec" unique)
    lines=$(spec_get "$spec" lines)
    lru=$(spec_get "$spec" lru)
    name=$(basename "$reads")

    # Exact (auto on a small trace) with every output.
    out=$(ssd mrc --trace "$reads" --csv reads.csv --plot reads.svg) || fail "$label: mrc on $name failed: $out"
    log "$label: mrc $name:
$out"
    assert_contains "$out" "method     exact" "$name is computed exactly under auto"
    assert_contains "$out" "footprint  $unique unique lines" "$name's footprint (unique 4 KiB blocks)"
    assert_contains "$out" "error      none" "the exact curve states no error"
    check_csv reads.csv 100 || fail "$label: reads.csv is not a valid curve: $(head -n 3 reads.csv)"
    python3 - reads.svg <<'EOF' || fail "$label: reads.svg is not a well-formed SVG chart"
import sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
assert root.tag.endswith("svg"), root.tag
texts = [t.text.strip() for t in root.iter() if t.tag.endswith("text") and t.text]
assert "hit ratio" in texts and "LRU, exact" in texts, texts
EOF

    # --csv - at 10% of the footprint: libCacheSim's LRU there; the CSV alone on standard
    # output, the summary on standard error.
    ssd mrc --trace "$reads" --csv - --sizes 1%,10%,1GiB >stdout.csv 2>summary.txt || fail "$label: mrc --csv - failed: $(cat summary.txt)"
    assert_eq "$(head -n 1 stdout.csv)" "cache_bytes,cache_lines,fraction_of_footprint,miss_ratio,hit_ratio" "--csv - header"
    assert_eq "$(wc -l <stdout.csv)" 4 "--csv - with three sizes"
    assert_contains "$(cat summary.txt)" "method     exact" "the summary goes to stderr with --csv -"
    assert_eq "$(sed -n 3p stdout.csv | cut -d, -f2)" "$lines" "10% of the footprint in lines"
    miss10=$(sed -n 3p stdout.csv | cut -d, -f4)
    python3 -c "import sys; sys.exit(0 if abs(float(sys.argv[1]) - float(sys.argv[2])) < 0.0001 else 1)" "$miss10" "$lru" \
        || fail "$label: $name at $lines lines: miss ratio $miss10, libCacheSim's LRU $lru"

    # --json: the same curve.
    json=$(ssd mrc --trace "$reads" --json --sizes 10%) || fail "$label: mrc --json failed"
    assert_eq "$(jq -r .method <<<"$json")" exact "--json method"
    assert_eq "$(jq '.points | length' <<<"$json")" 1 "--json points"
    assert_eq "$(jq -r '.points[0].miss_ratio' <<<"$json" | cut -c1-5)" "$(cut -c1-5 <<<"$miss10")" "--json and --csv agree"
    json=$(ssd mrc --trace "$reads" --json) || fail "$label: mrc --json failed"
    assert_eq "$(jq '.points | length' <<<"$json")" 100 "--json points"

    # SHARDS at a fixed rate, with --check: the error is stated and measured.
    out=$(ssd mrc --trace "$sampled" --method shards-rate --check --plot sampled.svg) || fail "$label: mrc shards-rate --check failed: $out"
    log "$label: mrc $(basename "$sampled") shards-rate --check:
$out"
    assert_contains "$out" "SHARDS, fixed rate 0.01" "shards-rate method line"
    assert_contains "$out" "expect a mean absolute error of about" "the expected error is stated"
    mae=$(grep -Eo 'absolute error of [0-9.]+' <<<"$out" | grep -Eo '[0-9.]+$') || fail "--check printed no MAE: $out"
    python3 -c "import sys; sys.exit(0 if 0 < float(sys.argv[1]) < 0.05 else 1)" "$mae" \
        || fail "$label: $(basename "$sampled") at 1%: MAE $mae"
    python3 -c "import sys, xml.etree.ElementTree as ET; ET.parse(sys.argv[1])" sampled.svg || fail "sampled.svg is not XML"
    grep -q "exact (--check)" sampled.svg || fail "the --check plot lacks the exact curve"

    # Fixed size, and auto past --exact-max-lines: SHARDS with the error stated.
    out=$(ssd mrc --trace "$reads" --method shards-size --max-keys 4096 --check) || fail "$label: shards-size failed: $out"
    assert_contains "$out" "sampled    4096 lines" "shards-size samples --max-keys lines"
    grep -Eq 'absolute error of 0\.0[0-4]' <<<"$out" || fail "$label: shards-size 4096 on $name: $out"
    out=$(ssd mrc --trace "$reads" --exact-max-lines 1000) || fail "$label: auto past the exact limit failed: $out"
    assert_contains "$out" "more than --exact-max-lines 1000 unique lines" "auto says why it sampled"
    assert_contains "$out" "K = 65536 sampled lines" "auto falls back to fixed-size SHARDS"

    # Bad input: status 1 and the file named; usage errors: status 2.
    expect_status 1 "missing\.trace.*No such file" "$SSDCACHE_BIN" mrc --trace missing.trace
    expect_status 1 "${name//./\\.} line 1: .*MSR" "$SSDCACHE_BIN" mrc --trace "$reads" --format msr
    head -c 100000 "$reads" >cut.lis.zst
    expect_status 1 "cut\.lis\.zst: corrupt or truncated zstd" "$SSDCACHE_BIN" mrc --trace cut.lis.zst
    { head -n 50 "$csv"; echo "1,2,0x28,oops,7"; } >corrupt.csv
    expect_status 1 "corrupt\.csv line 51" "$SSDCACHE_BIN" mrc --trace corrupt.csv --format vscsi-csv
    expect_status 2 "unknown trace format" "$SSDCACHE_BIN" mrc --trace "$reads" --format nosuch
    expect_status 2 "both write to standard output" "$SSDCACHE_BIN" mrc --trace "$reads" --json --csv -
    expect_status 2 "above 0%" "$SSDCACHE_BIN" mrc --trace "$reads" --sizes 0%
    expect_status 2 "power of two" "$SSDCACHE_BIN" mrc --trace "$reads" --line-size 1000
    expect_status 2 "sampling rate" "$SSDCACHE_BIN" mrc --trace "$reads" --method shards-rate --sample-rate 2
}

synthetic_traces "$TEST_DIR/synthetic"
zstd -q "$TEST_DIR/synthetic/skewed.lis" -o "$TEST_DIR/synthetic/skewed.lis.zst"
spec=$(synthetic_reference skewed.lis 10)
mrc_checks synthetic "$TEST_DIR/synthetic/skewed.lis.zst" "$spec" "$TEST_DIR/synthetic/skewed.lis.zst" \
    "$TEST_DIR/synthetic/phases.csv"

TRACES=$(shared_traces_dir)
if [[ -n "$TRACES" ]]; then
    P3=$(shared_trace "$TRACES" arc/P3.lis.zst)
    CLOUD=$(shared_trace "$TRACES" cloudphysics/cloudPhysicsIO.csv)
    # shared/traces/README.md: libCacheSim's LRU on arc/P3 at 10% (10,234 of 102,348 blocks).
    mrc_checks shared "$P3" "lines=10234 unique=102348 lru=0.7350" "$CLOUD" "$CLOUD"
else
    log "SSDCACHE_TRACES is not set: the checks on the shared traces did not run"
fi

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

log "mrc: all checks passed"
