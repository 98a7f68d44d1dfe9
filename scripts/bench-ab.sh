#!/usr/bin/env bash
# Same-run A/B of two `spendgate` binaries on the decision API (sqlite): each round starts
# each binary in turn on a fresh file and drives it with `spendgate-load --open-only` at RATE
# pairs/s for SECONDS, so the machine's drift hits both alike. Prints one line per run:
# reserve p50 / p99 / max, then pair-from-schedule p50 / p99 / max.
#
#   scripts/bench-ab.sh BIN_A BIN_B [ROUNDS] [RATE] [SECONDS]
# (e.g. copy target/release/spendgate aside, change the code, rebuild, compare.)
set -euo pipefail
cd "$(dirname "$0")/.."
A=$1; B=$2; ROUNDS=${3:-3}; RATE=${4:-1000}; SECONDS_EACH=${5:-5}
cargo build --release -q -p spendgate-server --bin spendgate-load
. scripts/bench-lib.sh
one() {
  local bin=$1 dir port pid out
  dir=$(mktemp -d); port=$(free_port)
  bench_config "$port" "kind = \"sqlite\"
path = \"$dir/bench.db\"" > "$dir/bench.toml"
  "$bin" serve --config "$dir/bench.toml" > "$dir/server.log" 2>&1 & pid=$!
  wait_url "http://127.0.0.1:$port/healthz"
  out=$(./target/release/spendgate-load --base "http://127.0.0.1:$port" --service-token "$BENCH_TOKEN" \
    --rate "$RATE" --seconds "$SECONDS_EACH" --open-only 2>&1 || true)
  echo "$(basename "$bin"): $(echo "$out" | grep -E "reserve latency|pair latency" | cut -d'|' -f3 | tr '\n' ' ')"
  kill $pid 2>/dev/null; wait $pid 2>/dev/null || true; rm -rf "$dir"
}
for _ in $(seq "$ROUNDS"); do one "$A"; one "$B"; done
