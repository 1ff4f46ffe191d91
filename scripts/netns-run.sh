#!/bin/sh
# Runs a command inside a network namespace of its own, for WebRTC between
# pages on one machine: Chromium never offers loopback ICE candidates, so the
# pages' data channels need an interface that is not `lo`. The namespace has
# `lo` and a veth pair (10.200.0.1 ↔ 10.200.0.2, the default route on it):
# host candidates are 10.200.0.1, every packet stays inside, and the relay,
# tracker and servers on 127.0.0.1 inside it are reached as usual. Nothing
# outside the namespace is reachable from it.
#
#   scripts/netns-run.sh npx playwright test e2e/fortunes-tiny.spec.ts
#
# Needs root (CI and the dev machines run as root) and `unshare` and `ip`
# (util-linux, iproute2). Inside, MESHNET_NETNS=1 tells tests they may open
# data channels; already inside one, the command runs as it is.
set -eu
if [ "${MESHNET_NETNS:-}" = 1 ]; then exec "$@"; fi
if [ "$(id -u)" != 0 ] || ! command -v unshare >/dev/null 2>&1 || ! command -v ip >/dev/null 2>&1; then
  echo "netns-run: needs root, unshare and ip to make a network namespace; running without one (WebRTC tests skip)" >&2
  exec "$@"
fi
exec unshare -n sh -c '
  set -e
  ip link set lo up
  ip link add veth0 type veth peer name veth1
  ip addr add 10.200.0.1/24 dev veth0
  ip addr add 10.200.0.2/24 dev veth1
  ip link set veth0 up
  ip link set veth1 up
  # Without a default route Chromium gathers no candidate at all.
  ip route add default via 10.200.0.2 dev veth0
  MESHNET_NETNS=1 exec "$@"' netns-run "$@"
