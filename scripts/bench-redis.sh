#!/usr/bin/env bash
# Redis store benchmark (issue 3): reserve+commit pairs through one replica and through three
# replicas on one private redis-server, and, on the same server in the same run, the physical
# limit: redis-benchmark throughput of a trivial EVALSHA script. Prints Markdown tables.
#
#   scripts/bench-redis.sh [RATE] [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
RATE=${1:-1000}
SECONDS_EACH=${2:-5}
. scripts/bench-lib.sh
cargo build --release -q -p "$SERVER_PKG" -p spendgate-bench --bins
dir=$(mktemp -d)
rport=$(free_port)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$dir"; }
trap cleanup EXIT
redis-server --port "$rport" --bind 127.0.0.1 --save "" --appendonly no --dir "$dir" --daemonize no > "$dir/redis.log" 2>&1 &
pids+=($!)
for _ in $(seq 50); do redis-cli -p "$rport" ping >/dev/null 2>&1 && break; sleep 0.1; done
token=$BENCH_TOKEN
bases=()
store="kind = \"redis\"
url = \"redis://127.0.0.1:$rport/0\"
prefix = \"bench\"
timeout_ms = 1000"
bench_config 0 "$store" > "$dir/init.toml"
# (the ledger id that `store init` prints, pinned in every replica's config)
pin=$(RUST_LOG=warn ./target/release/spendgate store init --config "$dir/init.toml" | grep '^ledger_id = ')
for i in 1 2 3; do
  port=$(free_port)
  bench_config "$port" "$store
$pin
witness_path = \"$dir/r$i.witness\"" > "$dir/r$i.toml"
  ./target/release/spendgate serve --config "$dir/r$i.toml" > "$dir/r$i.log" 2>&1 &
  pids+=($!)
  bases+=("http://127.0.0.1:$port")
done
for b in "${bases[@]}"; do
  wait_url "$b/readyz"
done
echo "spendgate $(git rev-parse --short HEAD), $(nproc) cores, $(date -u +%FT%TZ), redis $(redis-server --version | awk '{print $3}')"
echo
echo "### One replica"
./target/release/spendgate-load --base "${bases[0]}" --service-token "$token" --rate "$RATE" --seconds "$SECONDS_EACH" --concurrency 32 --runs 64
echo
echo "### Three replicas"
./target/release/spendgate-load --base "$(IFS=,; echo "${bases[*]}")" --service-token "$token" --rate "$RATE" --seconds "$SECONDS_EACH" --concurrency 48 --runs 96
echo
redis-cli -p "$rport" info commandstats | grep -E "evalsha|cmdstat_eval|fcall" | sed "s/^/    /" >&2 || true
sha=$(redis-cli -p "$rport" script load "return 1")
trivial=$(redis-benchmark -p "$rport" -c 50 -n 200000 -q evalsha "$sha" 0 | tr '\r' '\n' | grep -Eo '[0-9.]+ requests per second' | tail -1)
echo "### Physical limit on the same server"
echo "| measure | value |"
echo "|---|---|"
echo "| redis-benchmark, trivial EVALSHA, 50 clients | $trivial |"
