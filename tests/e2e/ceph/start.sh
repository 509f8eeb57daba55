#!/usr/bin/env bash
# tests/e2e/ceph/start.sh DIR — bring up a private single-node Ceph cluster (1 mon, 1 mgr,
# 1 bluestore OSD on a sparse file) in DIR, no systemd, no cephadm, all on
# 127.0.0.1, plus an RBD image exported over NBD by qemu-nbd.
#
# First run in an empty/nonexistent DIR creates the cluster; later runs in
# the same DIR restart it with its data. Prints the NBD URI on the last line
# of stdout. PIDs of everything started are appended to DIR/pids
# ("name pid" per line); stop.sh DIR kills exactly those.
#
# Env knobs: MON_PORT (default 43300; v2 on it, v1 on MON_PORT+1),
#   OSD_PORT_MIN (default 43400; OSD/mgr bind in [min, min+99]),
#   IMAGE_SIZE (default 512M), OSD_SIZE (bytes, default 4 GiB sparse),
#   POOL (default rbd), IMAGE (default disk), EXPORT (default disk),
#   OSD_MEMORY_TARGET (default 1 GiB), NO_MGR=1 to skip the manager,
#   START_TIMEOUT (seconds for each wait, default 120),
#   WAIT_HEALTH_OK=0 to return as soon as the NBD export works (default 1:
#   also wait, non-fatally, for HEALTH_OK, a few seconds more).
set -euo pipefail

[ $# -eq 1 ] || { echo "usage: $0 DIR" >&2; exit 2; }
mkdir -p "$1"
D=$(cd "$1" && pwd -P)

MON_PORT=${MON_PORT:-43300}
OSD_PORT_MIN=${OSD_PORT_MIN:-43400}
IMAGE_SIZE=${IMAGE_SIZE:-512M}
OSD_SIZE=${OSD_SIZE:-$((4 * 1024 * 1024 * 1024))}
POOL=${POOL:-rbd}
IMAGE=${IMAGE:-disk}
EXPORT=${EXPORT:-disk}
OSD_MEMORY_TARGET=${OSD_MEMORY_TARGET:-1073741824}
T=${START_TIMEOUT:-120}

CONF=$D/ceph.conf
KEYRING=$D/keyring
SOCK=$D/nbd.sock
export CEPH_CONF=$CONF   # NB: do not export CEPH_KEYRING: daemons honour it too
# Every CLI call is bounded: the client gives up connecting after 30 s and
# `timeout` is a backstop for anything that hangs after connecting.
ceph() { timeout 60 /usr/bin/ceph --connect-timeout 30 "$@"; }
rbd()  { timeout 60 /usr/bin/rbd "$@"; }

case $D in *[:@=\ ]*) echo "start.sh: DIR must not contain ':', '@', '=' or spaces (qemu rbd: spec)" >&2; exit 1;; esac
if [ ${#SOCK} -ge 100 ]; then
  echo "start.sh: DIR path too long for unix sockets (${#SOCK} chars)" >&2; exit 1
fi
for b in ceph-mon ceph-mgr ceph-osd ceph-authtool monmaptool qemu-nbd; do
  command -v $b >/dev/null || { echo "start.sh: $b missing, run setup.sh" >&2; exit 1; }
done

ts() { date +%s.%N; }
T0=$(ts)
el() { awk -v a="$T0" -v b="$(ts)" 'BEGIN{printf "%.1f", b-a}'; }
log() { echo "[start.sh +$(el)s] $*" >&2; }

# wait_for SECONDS DESCRIPTION CMD...: poll CMD every 0.5 s, bounded.
wait_for() {
  local secs=$1 what=$2; shift 2
  local end=$(( $(date +%s) + secs ))
  until "$@" >/dev/null 2>&1; do
    if [ "$(date +%s)" -ge "$end" ]; then
      log "timeout after ${secs}s waiting for: $what"; return 1
    fi
    sleep 0.5
  done
}

alive() { kill -0 "$1" 2>/dev/null; }

# launch NAME CMD...: run CMD in the background, record its PID.
launch() {
  local name=$1; shift
  "$@" </dev/null >>"$D/log/$name.out" 2>&1 &
  local pid=$!
  echo "$name $pid" >>"$D/pids"
  log "started $name pid $pid"
  eval "PID_${name//[.-]/_}=$pid"
}

port_free() {
  ! ss -Htln "sport = :$1" 2>/dev/null | grep -q .
}

# Refuse to start twice in the same DIR.
if [ -s "$D/pids" ]; then
  while read -r name pid; do
    if alive "$pid" && grep -qa -- "$D" "/proc/$pid/cmdline" 2>/dev/null; then
      echo "start.sh: $name (pid $pid) from DIR still running; run stop.sh $D first" >&2
      exit 1
    fi
  done <"$D/pids"
fi
: >"$D/pids"
# On any failure from here on, stop whatever this run started.
on_exit() {
  local rc=$?
  if [ $rc -ne 0 ]; then
    log "failed (rc $rc); stopping what was started"
    STOP_TIMEOUT=10 "$(dirname "$0")/stop.sh" "$D" || true
  fi
}
trap on_exit EXIT
mkdir -p "$D/log" "$D/run" "$D/mon" "$D/mgr" "$D/osd"

FRESH=0
[ -e "$D/initialized" ] || FRESH=1

if [ $FRESH = 1 ]; then
  for p in $MON_PORT $((MON_PORT + 1)); do
    port_free $p || { echo "start.sh: port $p in use; set MON_PORT" >&2; exit 1; }
  done
  log "creating a new cluster in $D"
  rm -rf "$D/mon" "$D/mgr" "$D/osd" "$D/run" "$D/monmap" "$KEYRING" "$CONF" "$SOCK"
  mkdir -p "$D/log" "$D/run" "$D/mon" "$D/mgr" "$D/osd"
  FSID=$(uuidgen)
  cat >"$CONF" <<EOF
[global]
fsid = $FSID
mon initial members = a
mon host = [v2:127.0.0.1:$MON_PORT,v1:127.0.0.1:$((MON_PORT + 1))]
public network = 127.0.0.0/8
cluster network = 127.0.0.0/8
ms bind ipv4 = true
ms bind ipv6 = false
ms bind port min = $OSD_PORT_MIN
ms bind port max = $((OSD_PORT_MIN + 99))
auth cluster required = cephx
auth service required = cephx
auth client required = cephx
auth allow insecure global id reclaim = false
run dir = $D/run
admin socket = $D/run/\$name.asok
pid file = $D/run/\$name.pid
log file = $D/log/\$name.log
log to stderr = false
err to stderr = true
mon cluster log file = $D/log/cluster.log
crash dir = $D/crash
exporter sock dir = $D/run
# one node, one OSD, no replicas
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd crush chooseleaf type = 0
mon allow pool size one = true
mon allow pool delete = true
mon warn on pool no redundancy = false
mon data avail warn = 2
mon data avail crit = 1
mon max pg per osd = 500
osd pool default pg autoscale mode = off

[mon]
mon data = $D/mon/\$cluster-\$id
keyring = $D/mon/\$cluster-\$id/keyring
mon osd full ratio = 0.97
mon osd backfillfull ratio = 0.96
mon osd nearfull ratio = 0.95

[mgr]
mgr data = $D/mgr/\$cluster-\$id
keyring = $D/mgr/\$cluster-\$id/keyring

[osd]
osd data = $D/osd/\$cluster-\$id
keyring = $D/osd/\$cluster-\$id/keyring
osd objectstore = bluestore
bluestore block path = $D/osd/block.img
bluestore block create = true
bluestore block size = $OSD_SIZE
bluestore block db create = false
bluestore block wal create = false
bluestore fsck on mkfs = false
bluestore fsck on mount = false
# bluefs log grows ~4 KiB/s and is only compacted past 16 MiB; replaying
# it costs ~1 ms per 4 KiB at every OSD start (8+ s). Compact early.
bluefs log compact min size = 1048576
osd memory target = $OSD_MEMORY_TARGET
osd crush update on start = true
osd max object name len = 256
osd max object namespace len = 64

[client]
keyring = $KEYRING
rbd cache = true
log file = $D/log/client.log
admin socket =
EOF

  ceph-authtool --create-keyring "$KEYRING" --gen-key -n mon. --cap mon 'allow *' >/dev/null
  ceph-authtool "$KEYRING" --gen-key -n client.admin \
    --cap mon 'allow *' --cap osd 'allow *' --cap mgr 'allow *' --cap mds 'allow *' >/dev/null
  chmod 600 "$KEYRING"
  monmaptool --create --fsid "$FSID" \
    --addv a "[v2:127.0.0.1:$MON_PORT,v1:127.0.0.1:$((MON_PORT + 1))]" "$D/monmap" >/dev/null
  mkdir -p "$D/mon/ceph-a"
  ceph-mon --mkfs -i a --monmap "$D/monmap" --keyring "$KEYRING" >>"$D/log/mkfs.out" 2>&1
  log "monitor created"
fi

# ---- monitor
launch mon ceph-mon -c "$CONF" -f -i a
wait_for "$T" "monitor quorum" ceph -s || { tail -20 "$D/log/mon.a.log" >&2; exit 1; }
log "monitor up"

# ---- manager
if [ "${NO_MGR:-0}" != 1 ]; then
  if [ ! -s "$D/mgr/ceph-x/keyring" ]; then
    mkdir -p "$D/mgr/ceph-x"
    ceph auth get-or-create mgr.x mon 'allow profile mgr' osd 'allow *' mds 'allow *' \
      -o "$D/mgr/ceph-x/keyring" >/dev/null
  fi
  launch mgr ceph-mgr -c "$CONF" -f -i x
fi

# ---- OSD
if [ ! -e "$D/osd/ceph-0/whoami" ]; then
  OSD_UUID=$(uuidgen)
  OSD_SECRET=$(ceph-authtool --gen-print-key)
  OSD_ID=$(printf '{"cephx_secret": "%s"}' "$OSD_SECRET" | ceph osd new "$OSD_UUID" -i -)
  [ "$OSD_ID" = 0 ] || { echo "start.sh: unexpected osd id '$OSD_ID'" >&2; exit 1; }
  mkdir -p "$D/osd/ceph-0"
  ceph-authtool --create-keyring "$D/osd/ceph-0/keyring" --name osd.0 --add-key "$OSD_SECRET" >/dev/null
  timeout "$T" ceph-osd -i 0 --mkfs --osd-uuid "$OSD_UUID" >>"$D/log/mkfs.out" 2>&1 \
    || { tail -30 "$D/log/mkfs.out" >&2; exit 1; }
  log "OSD created (bluestore on sparse file $D/osd/block.img)"
fi
launch osd ceph-osd -c "$CONF" -f -i 0
wait_for "$T" "osd.0 up" bash -c "ceph osd dump 2>/dev/null | grep -q '^osd.0 up'" \
  || { tail -30 "$D/log/osd.0.log" >&2; exit 1; }
log "OSD up"

# ---- pool + image
if [ $FRESH = 1 ]; then
  # size/min_size 1 come from osd_pool_default_{,min_}size in ceph.conf
  ceph osd pool create "$POOL" 8 8 replicated >/dev/null 2>&1
  log "pool created"
  rbd pool init "$POOL"          # also sets application rbd
  log "pool initialised"
  rbd create "$POOL/$IMAGE" --size "$IMAGE_SIZE"
  log "pool $POOL and image $IMAGE ($IMAGE_SIZE) created"
  touch "$D/initialized"
fi
# Usable = a client op on the image succeeds (blocks until its PGs are
# active). `ceph pg stat`/health lag behind: they come from the mgr's
# 5-second stats reports.
wait_for "$T" "image $POOL/$IMAGE readable" \
  rbd --rados-osd-op-timeout 10 --client-mount-timeout 10 info "$POOL/$IMAGE" \
  || { ceph -s >&2 || true; exit 1; }
log "pool I/O works"

# ---- NBD export
# The export's description names this cluster's fsid: a cluster made again is another store.
FSID=$(awk '$1 == "fsid" {print $3; exit}' "$CONF")
DESCRIPTION="ceph $FSID $POOL/$IMAGE"
printf 'POOL=%q\nIMAGE=%q\nEXPORT=%q\nDESCRIPTION=%q\n' "$POOL" "$IMAGE" "$EXPORT" "$DESCRIPTION" >"$D/export.env"
rm -f "$SOCK"
RBD_SPEC="rbd:$POOL/$IMAGE:conf=$CONF:id=admin:keyring=$KEYRING"
launch qemu-nbd qemu-nbd -f raw --cache=writeback -t -e 4 -x "$EXPORT" \
  -D "$DESCRIPTION" -k "$SOCK" "$RBD_SPEC"
URI="nbd+unix:///$EXPORT?socket=$SOCK"
nbd_up() {
  alive "$PID_qemu_nbd" || { log "qemu-nbd exited:"; tail -5 "$D/log/qemu-nbd.out" >&2; exit 1; }
  nbdinfo --size "$URI"
}
wait_for 60 "qemu-nbd socket" nbd_up || { tail -5 "$D/log/qemu-nbd.out" >&2; exit 1; }
log "NBD export ready: size $(nbdinfo --size "$URI") bytes"

if [ "${WAIT_HEALTH_OK:-1}" = 1 ] && [ "${NO_MGR:-0}" != 1 ]; then
  wait_for "$T" "HEALTH_OK" bash -c "/usr/bin/ceph --connect-timeout 10 health 2>/dev/null | grep -q '^HEALTH_OK'" \
    || log "WARNING: not HEALTH_OK: $(ceph health detail 2>&1 | head -5)"
fi
log "ready: $(ceph health 2>/dev/null | head -1)"
echo "$URI"
