#!/usr/bin/env bash
# The chaos run (issue 18): R replicas of the real `spendgate serve` on a private redis-server
# (AOF, appendfsync always), the mock upstream, M simulated guests running agent runs through
# the proxy and the decision API, and faults scheduled from the seed; at the end the books are
# checked against the upstream's own record of what it served (docs/chaos.md).
#
#   scripts/chaos.sh --seconds S --seed N [--replicas R] [--clients M] [--faults LIST]
#                    [--flood-connections N] [--plant NAME] [--logs DIR]
#
# Prints the schedule, a progress line every 10 s, then one table and, last,
# `overspend=N lost=N violations=N`. Exit status: 0 when every check held, 1 on any
# violation, 2 when the run could not be made. Loopback only; bounded: S seconds of load,
# then at most about a minute to let leases expire and check.
#
# Builds in release by default (CHAOS_PROFILE=debug for a debug build: slower replicas,
# debug assertions on). The build includes the planted-bug switches (cargo feature
# planted-bugs), inert unless --plant names one.
set -euo pipefail
cd "$(dirname "$0")/.."

profile=${CHAOS_PROFILE:-release}
case "$profile" in
  release) build=(--release); dir=target/release ;;
  debug) build=(); dir=target/debug ;;
  *) echo "chaos.sh: CHAOS_PROFILE is release or debug" >&2; exit 2 ;;
esac
if [ -z "${SPENDGATE_CHAOS_REDIS:-}" ] && ! command -v redis-server >/dev/null 2>&1 \
  && [ ! -x /usr/bin/redis-server ]; then
  echo "chaos.sh: redis-server is needed (apt-get install redis-server)" >&2
  exit 2
fi
cargo build --locked "${build[@]}" -p spendgate -p spendgate-chaos --bins
exec "$dir/spendgate-chaos" --spendgate "$dir/spendgate" "$@"
