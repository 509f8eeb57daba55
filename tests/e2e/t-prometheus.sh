#!/usr/bin/env bash
# `serve --metrics`: a real Prometheus server (Debian's package, started here on loopback)
# scrapes the endpoint every second during a write-back workload; its HTTP API then returns
# hit-ratio and dirty-data series that match `stats --json`, and every metric the Grafana
# dashboard (dist/grafana/ssdcache.json) uses exists in the scrape.
source "$(dirname "$0")/lib.sh"
require_tool prometheus curl jq qemu-io python3 truncate
require_bin
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
METRICS_PORT=$(free_port)
PROM_PORT=$(free_port)
mk_sparse backing.img 256M
mk_sparse cache.img 64M
create_cache cache.img backing.img --name vol0 --mode write-back
# Dirty data stays put while the series are compared: no age-based write-back.
start_server "$TEST_DIR/nbd.sock" --cache cache.img --metrics "127.0.0.1:$METRICS_PORT" --ssd-tbw 600 \
    --writeback-max-age 3600
URI=$(nbd_uri "$SOCK")

scrape=$(curl -sf "http://127.0.0.1:$METRICS_PORT/metrics") || fail "no answer on /metrics"
assert_contains "$scrape" '# EOF' "the OpenMetrics end marker"
assert_contains "$scrape" 'ssdcache_read_requests_total{volume="vol0",outcome="hit"}' "hit counter"
code=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$METRICS_PORT/other")
assert_eq "$code" 404 "status of a path other than /metrics"

cat >prometheus.yml <<YML
global:
  scrape_interval: 1s
scrape_configs:
  - job_name: ssdcache
    static_configs:
      - targets: ["127.0.0.1:$METRICS_PORT"]
YML
prometheus --config.file=prometheus.yml --storage.tsdb.path="$TEST_DIR/prom-data" \
    --web.listen-address="127.0.0.1:$PROM_PORT" >"$TEST_DIR/prometheus.log" 2>&1 &
_PIDS+=($!)
PROM="http://127.0.0.1:$PROM_PORT"
query() { curl -sf --get "$PROM/api/v1/query" --data-urlencode "query=$1"; }
for i in $(seq 1 60); do
    up=$(query 'up{job="ssdcache"}' 2>/dev/null | jq -r '.data.result[0].value[1] // empty' 2>/dev/null || true)
    [[ "$up" == 1 ]] && break
    sleep 0.5
done
[[ "${up:-}" == 1 ]] || fail "Prometheus did not scrape the endpoint within 30 s: $(tail -5 "$TEST_DIR/prometheus.log")"

# The workload: 4 MiB written (dirty in write-back), then reads of it (hits) and of data
# never written (misses), in rounds over about 5 s, bounded.
for round in $(seq 1 5); do
    qio "$URI" "write -P $round $(( (round - 1) * 4 ))M 1M" "read 0 1M" "read $(( 100 + round ))M 64k" >/dev/null
    sleep 1
done
# Two scrapes after the last request, so Prometheus holds the final values.
sleep 3
stats=$(stats_json cache.img)
want_ratio=$(vol_field "$stats" vol0 read_hit_ratio)
want_dirty=$(vol_field "$stats" vol0 dirty_bytes)
want_hits=$(vol_field "$stats" vol0 read_hits)
log "stats --json: read_hit_ratio $want_ratio, dirty_bytes $want_dirty, read_hits $want_hits"
assert_gt "$want_dirty" 0 "dirty bytes after write-back writes"
assert_gt "$want_hits" 0 "read hits during the workload"
got_ratio=$(query 'ssdcache_read_hit_ratio{volume="vol0"}' | jq -r '.data.result[0].value[1]')
got_dirty=$(query 'ssdcache_dirty_bytes{volume="vol0"}' | jq -r '.data.result[0].value[1]')
got_hits=$(query 'ssdcache_read_requests_total{volume="vol0",outcome="hit"}' | jq -r '.data.result[0].value[1]')
got_ratio2=$(query 'sum(ssdcache_read_requests_total{outcome="hit"}) / sum(ssdcache_read_requests_total)' | jq -r '.data.result[0].value[1]')
log "Prometheus: ratio $got_ratio (from counters $got_ratio2), dirty $got_dirty, hits $got_hits"
python3 - "$want_ratio" "$got_ratio" "$got_ratio2" <<'PY' || fail "hit ratio: stats $want_ratio, Prometheus $got_ratio / $got_ratio2"
import sys
want, a, b = map(float, sys.argv[1:])
sys.exit(0 if abs(want - a) < 1e-9 and abs(want - b) < 1e-9 else 1)
PY
assert_eq "$(printf '%.0f' "$got_dirty")" "$want_dirty" "dirty bytes in Prometheus against stats --json"
assert_eq "$(printf '%.0f' "$got_hits")" "$want_hits" "read hits in Prometheus against stats --json"
# The latency histogram counted the hits, as the hit counter did.
hit_latencies=$(query 'ssdcache_request_duration_seconds_count{volume="vol0",kind="read",outcome="hit"}' | jq -r '.data.result[0].value[1]')
assert_gt "$(printf '%.0f' "$hit_latencies")" 0 "read hits in the latency histogram"
# A series over time, not one value: the dirty data rose during the workload.
samples=$(query 'count_over_time(ssdcache_dirty_bytes{volume="vol0"}[1m])' | jq -r '.data.result[0].value[1]')
assert_gt "$samples" 5 "samples of the dirty-data series"
rose=$(query 'max_over_time(ssdcache_dirty_bytes{volume="vol0"}[1m]) - min_over_time(ssdcache_dirty_bytes{volume="vol0"}[1m])' | jq -r '.data.result[0].value[1]')
assert_gt "$(printf '%.0f' "$rose")" 0 "the dirty-data series changed over the workload"
# The oldest dirty data (written in the first round, over 7 s ago) has an age, in stats and
# in Prometheus; the cleaner refreshes it about every second.
want_age=$(jq -r '.oldest_dirty_age_seconds // empty' <<<"$stats")
assert_gt "${want_age:-0}" 4 "stats --json oldest_dirty_age_seconds"
got_age=$(query 'ssdcache_dirty_oldest_age_seconds' | jq -r '.data.result[0].value[1]')
assert_gt "$(printf '%.0f' "$got_age")" 3 "ssdcache_dirty_oldest_age_seconds in Prometheus"

# Every metric the dashboard uses exists in the scrape.
DASH="$E2E_DIR/../../dist/grafana/ssdcache.json"
[[ -f "$DASH" ]] || fail "no dashboard at $DASH"
scrape=$(curl -sf "http://127.0.0.1:$METRICS_PORT/metrics")
used=$(jq -r '.. | objects | select(has("expr")) | .expr' "$DASH" | grep -oE 'ssdcache_[a-z_]+' | sort -u)
[[ -n "$used" ]] || fail "the dashboard uses no ssdcache metric"
for m in $used; do
    grep -Eq "^$m(\{| )" <<<"$scrape" || fail "the dashboard uses $m, which the scrape lacks"
done
log "dashboard metrics all in the scrape: $(tr '\n' ' ' <<<"$used")"
# And Prometheus evaluates each panel's query without error.
while IFS= read -r expr; do
    expr=${expr//\$volume/vol0}
    expr=${expr//\$__rate_interval/1m}
    status=$(query "$expr" | jq -r .status) || fail "Prometheus refused the dashboard query: $expr"
    assert_eq "$status" success "dashboard query $expr"
done < <(jq -r '.. | objects | select(has("expr")) | .expr' "$DASH")
stop_server
