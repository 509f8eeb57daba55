#!/usr/bin/env bash
# serve --record-trace: a known qemu-io workload is recorded exactly (reads and writes as sent,
# write-zeroes as writes, trims and flushes not), the file is complete after SIGTERM and whole
# lines after kill -9; a sampled run keeps whole 1 MiB regions and stays within --record-max-size;
# stats shows the recording; bad settings and an existing file are refused.
source "$(dirname "$0")/lib.sh"
require_tool qemu-io jq truncate awk
require_bin
K=1024; M=$((1024 * 1024))

mk_sparse backing.img 512M
mk_sparse cache.img 64M
create_cache cache.img backing.img --name vol0 --mode write-through --line-size 64KiB

# count_records FILE: the number of records (lines that are not comments).
count_records() { awk '!/^#/ { n++ } END { print n + 0 }' "$1"; }

# data_lines FILE: the records (no comments), as "volume op offset length".
data_lines() { grep -v '^#' "$1" | awk -F, '{ print $2, $3, $4, $5 }'; }

# check_whole_lines FILE: the header as specified, every line ends with a newline, every record
# has five fields with numbers where numbers belong, and times never decrease.
check_whole_lines() {
    local f=$1
    assert_eq "$(head -n 1 "$f")" "# ssdcache-trace v1" "first line of $f"
    grep -q '^# sample_rate=[0-9.]* sample_region=1048576$' "$f" || fail "no sample_rate/sample_region line in $f: $(head -n 4 "$f")"
    grep -qx '# time_us,volume,op,offset,length' "$f" || fail "no column line in $f"
    [[ "$(tail -c 1 "$f" | od -An -c | tr -d ' ')" == '\n' ]] || fail "$f does not end with a newline"
    awk -F, '!/^#/ {
        if (NF != 5 || $1 !~ /^[0-9]+$/ || $3 !~ /^[RW]$/ || $4 !~ /^[0-9]+$/ || $5 !~ /^[0-9]+$/) {
            print "bad record at line " NR ": " $0; exit 1
        }
        if ($1 < last) { print "time goes back at line " NR ": " $0; exit 1 }
        last = $1
    }' "$f" || fail "malformed trace $f"
}

# ---- refusals, before anything is opened ----
expect_fail_stderr "sample rate 0" "record-sample" "$SSDCACHE_BIN" serve --cache cache.img --socket "$TEST_DIR/x.sock" --record-trace t0.csv --record-sample 0
expect_fail_stderr "sample rate 1.5" "record-sample" "$SSDCACHE_BIN" serve --cache cache.img --socket "$TEST_DIR/x.sock" --record-trace t0.csv --record-sample 1.5
expect_fail_stderr "tiny size bound" "too small" "$SSDCACHE_BIN" serve --cache cache.img --socket "$TEST_DIR/x.sock" --record-trace t0.csv --record-max-size 100
expect_fail_stderr "bound without a file" "need --record-trace" "$SSDCACHE_BIN" serve --cache cache.img --socket "$TEST_DIR/x.sock" --record-max-size 1MiB
echo precious >existing.csv
expect_fail_stderr "existing trace file" "already exists" "$SSDCACHE_BIN" serve --cache cache.img --socket "$TEST_DIR/x.sock" --record-trace existing.csv
assert_eq "$(cat existing.csv)" precious "an existing file is left alone"
expect_fail_stderr "trace in a missing directory" "cannot create trace file" "$SSDCACHE_BIN" serve --cache cache.img --socket "$TEST_DIR/x.sock" --record-trace nodir/t.csv
# A start that fails after the trace file was made takes the empty file away again.
expect_fail_stderr "missing cache" "nosuch.img" "$SSDCACHE_BIN" serve --cache nosuch.img --socket "$TEST_DIR/x.sock" --record-trace t0.csv
[[ ! -e t0.csv ]] || fail "a refused start created the trace file"

# ---- a known workload, recorded exactly ----
start_server "$TEST_DIR/nbd.sock" --cache cache.img --record-trace "$TEST_DIR/trace1.csv"
URI=$(nbd_uri "$SOCK")
st=$(stats_json cache.img)
assert_eq "$(jq -r .recording.state <<<"$st")" recording "stats .recording.state while recording"
assert_eq "$(jq -r .recording.path <<<"$st")" "$TEST_DIR/trace1.csv" "stats .recording.path"

qio "$URI" "write -P 0x11 0 $((4 * K))" "write -P 0x22 $((M)) $((64 * K))" >/dev/null
qio "$URI" "read -P 0x11 0 $((4 * K))" "read -P 0x22 $((M)) $((64 * K))" >/dev/null
qio "$URI" "write -z $((8 * M)) $((128 * K))" "discard $((16 * M)) $((64 * K))" "flush" >/dev/null
qio "$URI" "write -f -P 0x33 $((300 * M + 12 * K)) $((2 * M + 8 * K))" "read $((100 * M)) $((M))" >/dev/null
expected="vol0 W 0 $((4 * K))
vol0 W $((M)) $((64 * K))
vol0 R 0 $((4 * K))
vol0 R $((M)) $((64 * K))
vol0 W $((8 * M)) $((128 * K))
vol0 W $((300 * M + 12 * K)) $((2 * M + 8 * K))
vol0 R $((100 * M)) $((M))"

# The writer thread writes a partly filled buffer within a second: the file and the stats
# catch up while the daemon runs.
for ((i = 0; i < 50; i++)); do
    st=$(stats_json cache.img)
    [[ "$(jq -r .recording.records_written <<<"$st")" == 7 ]] && break
    sleep 0.1
done
log "stats while recording: $(jq -c .recording <<<"$st")"
assert_eq "$(jq -r .recording.records_written <<<"$st")" 7 "records_written in stats"
assert_eq "$(jq -r .recording.records_dropped <<<"$st")" 0 "records_dropped in stats"
assert_eq "$(jq -r .recording.bytes_written <<<"$st")" "$(stat -c %s trace1.csv)" "bytes_written in stats = file size"
assert_eq "$(data_lines trace1.csv)" "$expected" "records on disk while serving"
txt=$("$SSDCACHE_BIN" stats --cache cache.img)
assert_contains "$txt" "trace $TEST_DIR/trace1.csv (recording): 7 requests" "stats (text) shows the recording"
stop_server

check_whole_lines trace1.csv
assert_eq "$(data_lines trace1.csv)" "$expected" "recorded requests after SIGTERM"
assert_eq "$(tail -n 1 trace1.csv)" "# end records=7 dropped=0 reason=shutdown" "closing line"
grep -q '^# sample_rate=1 sample_region=1048576$' trace1.csv || fail "rate 1 not in the header"
grep -q "trace1.csv: 7 requests recorded" "$SERVER_LOG" || fail "no recording summary in the log: $(tail -n 5 "$SERVER_LOG")"
log "trace1.csv holds exactly the 7 reads and writes qemu-io sent:
$(cat trace1.csv)"

# The file now exists: a second start refuses it, --record-trace-force replaces it.
expect_fail_stderr "restart onto the same trace" "already exists" "$SSDCACHE_BIN" serve --cache cache.img --socket "$TEST_DIR/x.sock" --record-trace trace1.csv

# ---- sampled, bounded: 25% of the regions, at most 16 KiB ----
# 5 passes over 256 regions, two 4 KiB reads per region: about 640 sampled records of ~30
# bytes, more than the bound holds.
cmds=()
for ((pass = 0; pass < 5; pass++)); do
    for ((r = 0; r < 256; r++)); do
        cmds+=("read $((r * M)) $((4 * K))" "read $((r * M + 512 * K)) $((4 * K))")
    done
done
start_server "$TEST_DIR/nbd.sock" --cache cache.img --record-trace trace1.csv --record-trace-force \
    --record-sample 0.25 --record-max-size 16KiB
qio "$URI" "${cmds[@]}" >/dev/null
st=$(stats_json cache.img)
log "stats after the sampled run: $(jq -c .recording <<<"$st")"
assert_eq "$(jq -r .recording.state <<<"$st")" size-limit "recording state after passing the bound"
assert_eq "$(jq -r .recording.path <<<"$st")" "$TEST_DIR/trace1.csv" "stats names the file by its absolute path"
qio "$URI" "read -P 0x11 0 $((4 * K))" >/dev/null   # still serving
stop_server
size=$(stat -c %s trace1.csv)
((size <= 16 * K)) || fail "trace of $size bytes passes --record-max-size 16KiB"
((size > 15 * K)) || fail "trace stopped early at $size bytes"
check_whole_lines trace1.csv
grep -q '^# sample_rate=0.25 sample_region=1048576$' trace1.csv || fail "rate 0.25 not in the header"
assert_eq "$(tail -n 1 trace1.csv)" "# end records=$(count_records trace1.csv) dropped=0 reason=size-limit" "closing line"
assert_eq "$(grep -c 'WARN.*size limit of' "$SERVER_LOG")" 1 "size-limit warnings in the log"
# Whole regions: a recorded region has both of its offsets recorded, in every complete pass.
data_lines trace1.csv | awk -v M=$M '{ r = int($3 / M); n[r]++; w[r, $3 - r * M] = 1 }
    END {
        for (r in n) if (!w[r, 0] || !w[r, 524288]) { print "region " r " split"; exit 1 }
        print length(n)
    }' >regions.out || fail "sampling split a region: $(cat regions.out)"
regions=$(cat regions.out)
((regions >= 32 && regions <= 100)) || fail "$regions of 256 regions sampled at rate 0.25"
log "sampled run: $size bytes, $regions of 256 regions, $(count_records trace1.csv) records"

# ---- the config file, and kill -9 ----
cat >serve.toml <<EOF
cache = "$TEST_DIR/cache.img"
record_trace = "$TEST_DIR/trace3.csv"
record_sample = 1
record_max_size = "1MiB"
EOF
start_server "$TEST_DIR/nbd.sock" --config serve.toml
qio "$URI" "write -P 0x44 $((20 * M)) $((8 * K))" "read -P 0x44 $((20 * M)) $((8 * K))" >/dev/null
for ((i = 0; i < 50; i++)); do
    (($(count_records trace3.csv) == 2)) && break
    sleep 0.1
done
kill9_server
check_whole_lines trace3.csv
assert_eq "$(data_lines trace3.csv)" "vol0 W $((20 * M)) $((8 * K))
vol0 R $((20 * M)) $((8 * K))" "records after kill -9"
grep -q 'max_size=1048576' trace3.csv || fail "record_max_size from the config file not in the header"
log "after kill -9 the trace is whole up to its last line (no closing line: $(tail -n 1 trace3.csv))"
