#!/usr/bin/env bash
# While ssdcache serves, the kernel refuses to mount its backing block device (or let another
# exclusive opener have it): the backing device opened with O_EXCL. A write-back volume's
# filesystem on the backing device keeps its UUID, so a mount by UUID at boot could otherwise
# pick the stale disk behind the cache. Before serve, a mounted backing device is refused with
# a clear message; after a clean stop it mounts again.
source "$(dirname "$0")/lib.sh"
require_tool losetup mkfs.ext4 mount umount python3 truncate
require_bin
truncate -s 64M backing.img
mkfs.ext4 -q -F backing.img
loop_attach backing.img
BACKING=$LOOP_DEV
mk_sparse cache.img 32M
create_cache cache.img "$BACKING" --name vol0 --mode write-back
start_server "$TEST_DIR/nbd.sock" --cache cache.img
mkdir -p mnt
rc=0
out=$(mount "$BACKING" mnt 2>&1) || rc=$?
if [[ $rc -eq 0 ]]; then
    umount mnt
    fail "the backing device $BACKING was mounted while ssdcache served it"
fi
log "mount while serving refused (status $rc): $out"
python3 - "$BACKING" <<'PY' || fail "another exclusive open of $BACKING succeeded while ssdcache served it"
import errno, os, sys
try:
    fd = os.open(sys.argv[1], os.O_RDONLY | os.O_EXCL)
except OSError as e:
    sys.exit(0 if e.errno == errno.EBUSY else 1)
os.close(fd)
sys.exit(1)
PY
# Reading it without O_EXCL (blkid, monitoring) still works.
dd if="$BACKING" of=/dev/null bs=4096 count=1 status=none || fail "a plain read of the backing device failed"
stop_server
# Stopped: the device is free; mounted, serve refuses it clearly (exit 1).
do_mount "$BACKING" "$TEST_DIR/mnt"
expect_status 1 "serve with the backing device mounted" 'in use: mounted, or held by another program' \
    "$SSDCACHE_BIN" serve --cache cache.img --socket "$TEST_DIR/nbd2.sock"
do_umount "$TEST_DIR/mnt"
start_server "$TEST_DIR/nbd.sock" --cache cache.img
stop_server
