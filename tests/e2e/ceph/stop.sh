#!/usr/bin/env bash
# tests/e2e/ceph/stop.sh DIR — stop what start.sh DIR started: exactly the PIDs listed in
# DIR/pids, in reverse start order (qemu-nbd, osd, mgr, mon). SIGTERM, wait
# up to STOP_TIMEOUT seconds (default 20) per process, then SIGKILL and wait
# up to 5 s more. A PID is only signalled if it is still alive and its
# command line still mentions DIR (guards against PID reuse).
# Data stays in DIR; start.sh DIR brings the same cluster back.
set -uo pipefail

[ $# -eq 1 ] || { echo "usage: $0 DIR" >&2; exit 2; }
[ -d "$1" ] || { echo "stop.sh: no such dir $1" >&2; exit 0; }
D=$(cd "$1" && pwd -P)
T=${STOP_TIMEOUT:-20}
[ -s "$D/pids" ] || { echo "stop.sh: nothing to stop in $D" >&2; exit 0; }

ours() {  # ours PID: alive and started for this DIR
  kill -0 "$1" 2>/dev/null && tr '\0' ' ' <"/proc/$1/cmdline" 2>/dev/null | grep -qF -- "$D"
}

gone_within() {  # gone_within PID TENTHS
  local i=0
  while [ $i -lt "$2" ]; do
    kill -0 "$1" 2>/dev/null || return 0
    # a zombie child of ours counts as gone
    [ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" = Z ] && return 0
    sleep 0.1; i=$((i + 1))
  done
  return 1
}

rc=0
# reverse order: last started first
tac "$D/pids" | while read -r name pid; do
  [ -n "${pid:-}" ] || continue
  if ! ours "$pid"; then
    echo "stop.sh: $name pid $pid not running (or not ours), skipped" >&2
    continue
  fi
  t0=$(date +%s.%N)
  kill -TERM "$pid" 2>/dev/null
  if ! gone_within "$pid" $((T * 10)); then
    echo "stop.sh: $name pid $pid ignored SIGTERM for ${T}s, SIGKILL" >&2
    kill -KILL "$pid" 2>/dev/null
    gone_within "$pid" 50 || { echo "stop.sh: $name pid $pid survived SIGKILL" >&2; rc=1; }
  fi
  echo "stop.sh: stopped $name pid $pid in $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}')s" >&2
done
# keep the file (for inspection) but mark it used
mv -f "$D/pids" "$D/pids.stopped"
rm -f "$D/nbd.sock"
exit $rc
