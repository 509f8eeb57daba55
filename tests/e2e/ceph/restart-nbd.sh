#!/usr/bin/env bash
# tests/e2e/ceph/restart-nbd.sh DIR [SIGNAL] — restart only the qemu-nbd export of a running
# start.sh cluster (to test that data survives an NBD server restart).
# Kills the qemu-nbd PID recorded in DIR/pids (SIGNAL, default TERM; KILL loses what librbd's
# write-back cache held, as a crash would; bounded wait, then SIGKILL), starts a new one with
# the same arguments, updates DIR/pids, prints the NBD URI.
set -euo pipefail
[ $# -ge 1 ] && [ $# -le 2 ] || { echo "usage: $0 DIR [SIGNAL]" >&2; exit 2; }
SIGNAL=${2:-TERM}
D=$(cd "$1" && pwd -P)
. "$D/export.env"
SOCK=$D/nbd.sock
old=$(awk '$1=="qemu-nbd"{print $2}' "$D/pids" | tail -1)
if [ -n "$old" ] && kill -0 "$old" 2>/dev/null && tr '\0' ' ' <"/proc/$old/cmdline" | grep -qF -- "$D"; then
  kill -"$SIGNAL" "$old"
  for _ in $(seq 100); do kill -0 "$old" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$old" 2>/dev/null && { kill -KILL "$old"; sleep 0.5; }
fi
sed -i '/^qemu-nbd /d' "$D/pids"
rm -f "$SOCK"
qemu-nbd -f raw --cache=writeback -t -e 4 -x "$EXPORT" -D "$DESCRIPTION" -k "$SOCK" \
  "rbd:$POOL/$IMAGE:conf=$D/ceph.conf:id=admin:keyring=$D/keyring" \
  </dev/null >>"$D/log/qemu-nbd.out" 2>&1 &
pid=$!
echo "qemu-nbd $pid" >>"$D/pids"
URI="nbd+unix:///$EXPORT?socket=$SOCK"
end=$(( $(date +%s) + 60 ))
until nbdinfo --size "$URI" >/dev/null 2>&1; do
  kill -0 "$pid" 2>/dev/null || { echo "qemu-nbd died:" >&2; tail -5 "$D/log/qemu-nbd.out" >&2; exit 1; }
  [ "$(date +%s)" -lt "$end" ] || { echo "timeout waiting for qemu-nbd" >&2; exit 1; }
  sleep 0.2
done
echo "$URI"
