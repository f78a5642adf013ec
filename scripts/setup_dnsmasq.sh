#!/usr/bin/env bash
# dnsmasq for the DNS membership tests (tests/integration/test_gateway_fleet_changes.py,
# benchmarks/fleet_changes.py): Debian's package, started by the tests themselves as a plain
# process on a loopback port (never as a system service). Does nothing if it is installed;
# if it cannot be installed (no root, no apt), says so and the tests skip with that reason.
set -uo pipefail
if command -v dnsmasq >/dev/null 2>&1 || [ -x /usr/sbin/dnsmasq ]; then
  exit 0
fi
if [ "$(id -u)" != "0" ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "setup_dnsmasq.sh: cannot install dnsmasq here (needs root and apt-get); the DNS tests will skip" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
if ! apt-get install -y --no-install-recommends dnsmasq >/dev/null 2>&1; then
  apt-get update >/dev/null 2>&1 || true
  apt-get install -y --no-install-recommends dnsmasq >/dev/null 2>&1 \
    || echo "setup_dnsmasq.sh: apt-get install dnsmasq failed; the DNS tests will skip" >&2
fi
# The package may start a system-wide instance on port 53; the tests need none.
if command -v systemctl >/dev/null 2>&1; then
  systemctl disable --now dnsmasq >/dev/null 2>&1 || true
fi
exit 0
