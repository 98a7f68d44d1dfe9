#!/usr/bin/env bash
# Proxy benchmark: the latency `POST /v1/chat/completions` through spendgate adds over calling
# the upstream directly. Starts the mock upstream (unpaced tokens) and
# `spendgate serve` (release build, sqlite store: every call is a one-step run admitted,
# reserved, forwarded, committed and finished) on free loopback ports, then runs the open-loop
# driver `spendgate-proxy-load`, which sends the same requests at RATE per second to each path,
# interleaved, in one run. Prints Markdown tables.
#
#   scripts/bench-proxy.sh [RATE] [SECONDS] [DRIVER OPTIONS...]
#
# e.g. `scripts/bench-proxy.sh 5000 5 --sequential --paced-tokens-per-second 0`: each path
# alone at 5,000 requests/s, one after the other (see `spendgate-proxy-load --help`).
# `scripts/bench-proxy.sh 1 8 --clients 50 --compare-direct` runs the driver's closed loop
# instead: 50 concurrent calls straight to the mock, then through spendgate (RATE unused).
# SPENDGATE_BENCH_UPSTREAM_MS: the mock's latency before its answer (default 0).
# SPENDGATE_BENCH_BIN runs another server binary (an A/B against an older build; the mock
# upstream and the driver stay this build's).
set -euo pipefail
cd "$(dirname "$0")/.."
RATE=${1:-200}
SECONDS_EACH=${2:-10}
shift $(( $# < 2 ? $# : 2 ))
. scripts/bench-lib.sh
cargo build --release -q -p "$SERVER_PKG" -p spendgate-bench -p spendgate-mock-upstream --bins
dir=$(mktemp -d)
port=$(free_port)
mport=$(free_port)
token=$BENCH_TOKEN
bench_config "$port" "kind = \"sqlite\"
path = \"$dir/bench.db\"" "[models.\"mock-model\"]
upstream = \"bench\"
input_per_million = \"0.15\"
cached_input_per_million = \"0.075\"
output_per_million = \"0.60\"
tokenizer = \"bytes\"
[upstreams.bench]
base_url = \"http://127.0.0.1:$mport/v1\"
api_key = \"bench-upstream-key\"
timeout_s = 30" > "$dir/bench.toml"
./target/release/mock-upstream --listen "127.0.0.1:$mport" --latency-ms "${SPENDGATE_BENCH_UPSTREAM_MS:-0}" > "$dir/mock.log" 2>&1 &
mpid=$!
RUST_LOG=warn ${SPENDGATE_BENCH_BIN:-./target/release/spendgate} serve --config "$dir/bench.toml" > "$dir/server.log" 2>&1 &
pid=$!
trap 'kill $pid $mpid 2>/dev/null; wait $pid $mpid 2>/dev/null || true; rm -rf "$dir"' EXIT
wait_url "http://127.0.0.1:$port/healthz" "http://127.0.0.1:$mport/v1/models"
echo "spendgate $(git rev-parse --short HEAD), $(nproc) cores, $(date -u +%FT%TZ)"
./target/release/spendgate-proxy-load --proxy "http://127.0.0.1:$port" --direct "http://127.0.0.1:$mport" \
  --service-token "$token" --rate "$RATE" --seconds "$SECONDS_EACH" "$@"
echo
echo "mock upstream counted: $(curl -fs "http://127.0.0.1:$mport/mock/stats" | python3 -c 'import json,sys; s=json.load(sys.stdin); print(s["requests"], "requests,", s["completed"], "completed")')"
echo "spendgate: $(curl -fs -H "$BENCH_ADMIN_AUTH" "http://127.0.0.1:$port/metrics" | grep -E '^spendgate_(admissions_total\{what="proxy_step"\}|unknown_outcomes_total|reservations_held) ' | tr '\n' ' ')"
echo
echo "| measure | value |"
echo "|---|---|"
fsync_floor "$dir"
