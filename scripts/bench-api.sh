#!/usr/bin/env bash
# Decision-API benchmark: starts `spendgate serve` (release build, sqlite store, every
# reservation fsynced before its answer) on a free loopback port, then runs the open-loop
# driver `spendgate-load` against it: /healthz baseline, closed-loop pairs/s, and open-loop
# latency at a fixed rate, all in one run. Prints a Markdown table.
#
#   scripts/bench-api.sh [RATE] [SECONDS]
# SPENDGATE_BENCH_ENV adds environment to the server (e.g. TOKIO_WORKER_THREADS=1);
# SPENDGATE_BENCH_BIN runs another server binary (an A/B against an older build).
set -euo pipefail
cd "$(dirname "$0")/.."
RATE=${1:-1000}
SECONDS_EACH=${2:-5}
. scripts/bench-lib.sh
cargo build --release -q -p "$SERVER_PKG" -p spendgate-bench --bins
dir=$(mktemp -d)
port=$(free_port)
token=$BENCH_TOKEN
bench_config "$port" "kind = \"sqlite\"
path = \"$dir/bench.db\"" > "$dir/bench.toml"
env ${SPENDGATE_BENCH_ENV:-} ${SPENDGATE_BENCH_BIN:-./target/release/spendgate} serve --config "$dir/bench.toml" > "$dir/server.log" 2>&1 &
sleep 0.2; if ! kill -0 $! 2>/dev/null; then cat "$dir/server.log"; exit 1; fi
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null || true; rm -rf "$dir"' EXIT
wait_url "http://127.0.0.1:$port/healthz"
echo "spendgate $(git rev-parse --short HEAD), $(nproc) cores, $(date -u +%FT%TZ)"
./target/release/spendgate-load --base "http://127.0.0.1:$port" --service-token "$token" \
  --rate "$RATE" --seconds "$SECONDS_EACH" --concurrency 32,128 --runs 128
fsync_floor "$dir"
