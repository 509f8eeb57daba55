#!/usr/bin/env bash
# tests/e2e/ceph/setup.sh (run by scripts/install-deps). Installs what start.sh needs: a single-node Ceph (Debian bookworm, 16.2.x)
# and qemu's rbd block driver (qemu-block-extra) matching the installed
# qemu-utils. Idempotent: does nothing (no network) when all is present.
set -euo pipefail

PKGS=(ceph-mon ceph-mgr ceph-osd ceph-common qemu-utils qemu-block-extra libnbd-bin uuid-runtime iproute2)

have_all() {
  local p
  for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || return 1
  done
  # qemu-block-extra must be exactly the qemu-utils version, or qemu
  # silently refuses to load block-rbd.so ("Unknown protocol 'rbd'").
  [ "$(dpkg-query -W -f='${Version}' qemu-utils)" = "$(dpkg-query -W -f='${Version}' qemu-block-extra)" ] || return 1
  [ -e /usr/lib/x86_64-linux-gnu/qemu/block-rbd.so ] || return 1
}

if have_all; then
  echo "setup.sh: everything already installed"
  exit 0
fi

export DEBIAN_FRONTEND=noninteractive
QEMU_VER=$(dpkg-query -W -f='${Version}' qemu-utils 2>/dev/null || true)

# qemu-utils on this machine comes from bookworm-backports (1:10.x); the
# matching qemu-block-extra is only there. Add the suite (low priority by
# default: nothing else gets pulled from it unless asked for).
if [[ "$QEMU_VER" == *bpo12* ]]; then
  if ! grep -rqs 'bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/; then
    echo 'deb http://deb.debian.org/debian bookworm-backports main' \
      > /etc/apt/sources.list.d/bookworm-backports.list
  fi
fi

timeout 300 apt-get update -q

if [ -n "$QEMU_VER" ]; then
  QBE="qemu-block-extra=$QEMU_VER"     # pin exactly: never downgrade qemu-utils
else
  QBE="qemu-block-extra"; PKGS_Q="qemu-utils"
fi

# Refuse anything that would remove or downgrade a package.
SIM=$(apt-get install -s --no-install-recommends ceph-mon ceph-mgr ceph-osd ceph-common libnbd-bin uuid-runtime iproute2 ${PKGS_Q:-} "$QBE" 2>&1) || { echo "$SIM" >&2; exit 1; }
if grep -qE '^Remv|downgrad' <<<"$SIM"; then
  echo "setup.sh: apt would remove/downgrade packages, refusing:" >&2
  grep -E '^Remv|downgrad' <<<"$SIM" >&2
  exit 1
fi

timeout 900 apt-get install -y -q --no-install-recommends \
  ceph-mon ceph-mgr ceph-osd ceph-common libnbd-bin uuid-runtime iproute2 ${PKGS_Q:-} "$QBE"

have_all || { echo "setup.sh: install finished but checks fail" >&2; exit 1; }
echo "setup.sh: done"
