#!/usr/bin/env bash
# Debian services the default suite runs for real, each started by the tests themselves as a
# plain process on a loopback port (never as a system service):
#   dnsmasq     DNS membership (tests/integration/test_gateway_fleet_changes.py,
#               benchmarks/fleet_changes.py)
#   prometheus  the Grafana dashboard's queries (tests/integration/test_grafana_dashboard.py)
#   redis       shared routing state and rate limits across gateway instances
#               (tests/integration/test_shared_state*.py, benchmarks/shared_state.py)
# Does nothing for what is installed; what cannot be installed (no root, no apt) is said here
# and its tests skip with that reason.
set -uo pipefail
missing=()
{ command -v dnsmasq >/dev/null 2>&1 || [ -x /usr/sbin/dnsmasq ]; } || missing+=(dnsmasq)
command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != "0" ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "setup_test_services.sh: cannot install ${missing[*]} here (needs root and apt-get); their tests will skip" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
if ! apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null 2>&1; then
  apt-get update >/dev/null 2>&1 || true
  apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null 2>&1 \
    || echo "setup_test_services.sh: apt-get install ${missing[*]} failed; their tests will skip" >&2
fi
# The packages may start system-wide instances (port 53, 9090, 6379); the tests need none.
if command -v systemctl >/dev/null 2>&1; then
  systemctl disable --now dnsmasq prometheus redis-server >/dev/null 2>&1 || true
fi
exit 0
