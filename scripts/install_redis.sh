#!/usr/bin/env bash
# redis-server for the shared-state tests and benchmark (Debian/Ubuntu package); a no-op
# when it is already installed. Tests start it themselves on a free loopback port.
set -euo pipefail
if command -v redis-server >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1; then SUDO=sudo; else SUDO=; fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
command -v redis-server
