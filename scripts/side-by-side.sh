#!/usr/bin/env bash
# The side-by-side load of issue 18 (finding 6): ordinary load must never trip fail-closed.
# For each case, on fresh loopback processes: the mock upstream at LATENCY ms before its first
# byte, `spendgate serve` (release build, limits that never bind, `store.timeout_ms` 100 and
# the other store keys at their defaults) on the STORE, and the closed-loop driver
# `spendgate-proxy-load --clients 50`: 50 clients each sending one proxied, non-streaming
# chat completion after the other for SECONDS. The Redis cases run their own redis-server
# (AOF on, `appendfsync always`, `noeviction`: README's recommended settings).
# Prints, per case, the calls, the refusals by status and code and the 503s, then a table;
# exits 1 if any call was refused with 503 (or the load could not run).
#
#   scripts/side-by-side.sh [--seconds S] [--clients N] [--runs R] [CASE...]
#
# CASE is STORE:LATENCY (default: sqlite:200 sqlite:0 redis:200 redis:0).
# SPENDGATE_BENCH_BIN runs another server binary (an older build, to reproduce what it did);
# SPENDGATE_REDIS_SERVER another redis-server (or valkey-server).
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_EACH=20
CLIENTS=50
RUNS=1
cases=()
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) SECONDS_EACH=$2; shift 2 ;;
    --clients) CLIENTS=$2; shift 2 ;;
    --runs) RUNS=$2; shift 2 ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) cases+=("$1"); shift ;;
  esac
done
[ ${#cases[@]} -gt 0 ] || cases=(sqlite:200 sqlite:0 redis:200 redis:0)
# Bounds: this is a load on a shared machine, not a soak.
[ "$SECONDS_EACH" -ge 1 ] && [ "$SECONDS_EACH" -le 300 ] || { echo "--seconds must be 1..300" >&2; exit 2; }
[ "$CLIENTS" -ge 1 ] && [ "$CLIENTS" -le 1024 ] || { echo "--clients must be 1..1024" >&2; exit 2; }
[ "$RUNS" -ge 1 ] && [ "$RUNS" -le 20 ] || { echo "--runs must be 1..20" >&2; exit 2; }
for c in "${cases[@]}"; do
  case "$c" in
    sqlite:[0-9]*|redis:[0-9]*) ;;
    *) echo "unknown case $c (STORE:LATENCY, STORE sqlite or redis)" >&2; exit 2 ;;
  esac
done
REDIS_SERVER=${SPENDGATE_REDIS_SERVER:-redis-server}
BIN=${SPENDGATE_BENCH_BIN:-./target/release/spendgate}
cargo build --release -q -p spendgate -p spendgate-bench -p spendgate-mock-upstream --bins
. scripts/bench-lib.sh
dir=$(mktemp -d)
pids=()
stop_all() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  pids=()
}
trap 'stop_all; rm -rf "$dir"' EXIT

# run_case STORE LATENCY N: one case; prints the driver's output and appends a table row.
rows=()
failed=0
run_case() {
  local store=$1 latency=$2 n=$3 work="$dir/$1-$2-$3"
  mkdir -p "$work"
  local port mport store_toml
  port=$(free_port)
  mport=$(free_port)
  if [ "$store" = redis ]; then
    local rport
    rport=$(free_port)
    "$REDIS_SERVER" --port "$rport" --bind 127.0.0.1 --save "" --appendonly yes \
      --appendfsync always --maxmemory-policy noeviction --dir "$work" --daemonize no \
      > "$work/redis.log" 2>&1 &
    pids+=($!)
    for _ in $(seq 50); do redis-cli -p "$rport" ping >/dev/null 2>&1 && break; sleep 0.1; done
    store_toml="kind = \"redis\"
url = \"redis://127.0.0.1:$rport/0\"
prefix = \"side\"
timeout_ms = 100"
  else
    store_toml="kind = \"sqlite\"
path = \"$work/side.db\"
timeout_ms = 100"
  fi
  write_config() {
    bench_config "$port" "$store_toml" "[models.\"mock-model\"]
upstream = \"side\"
input_per_million = \"0.15\"
cached_input_per_million = \"0.075\"
output_per_million = \"0.60\"
tokenizer = \"bytes\"
[upstreams.side]
base_url = \"http://127.0.0.1:$mport/v1\"
api_key = \"side-upstream-key\"
timeout_s = 30" > "$work/side.toml"
  }
  write_config
  if [ "$store" = redis ]; then
    # (the ledger id `store init` prints, pinned in the replica's config; older builds print
    # none and need none)
    local pin
    pin=$(RUST_LOG=warn "$BIN" store init --config "$work/side.toml" 2> "$work/init.log" | grep '^ledger_id = ' || true)
    if [ -n "$pin" ]; then
      store_toml="$store_toml
$pin
witness_path = \"$work/side.witness\""
      write_config
    fi
  fi
  ./target/release/mock-upstream --listen "127.0.0.1:$mport" --latency-ms "$latency" \
    > "$work/mock.log" 2>&1 &
  pids+=($!)
  RUST_LOG=warn "$BIN" serve --config "$work/side.toml" > "$work/server.log" 2>&1 &
  pids+=($!)
  wait_url "http://127.0.0.1:$port/readyz" "http://127.0.0.1:$mport/v1/models"
  echo "### $store, upstream $latency ms, run $n"
  local out
  out=$(./target/release/spendgate-proxy-load --proxy "http://127.0.0.1:$port" \
    --direct "http://127.0.0.1:$mport" --service-token "$BENCH_TOKEN" \
    --clients "$CLIENTS" --seconds "$SECONDS_EACH")
  echo "$out"
  # Every store call by latency (the server's own histogram: the proxy's calls and the lease
  # sweeper's alike): how many a bound of 100 ms, 250 ms, ... would have cut.
  curl -fs -H "$BENCH_ADMIN_AUTH" "http://127.0.0.1:$port/metrics" | python3 -c '
import sys
b = {}
for line in sys.stdin:
    if line.startswith("spendgate_store_call_seconds_bucket{le=\""):
        le = line.split("\"")[1]
        b[le] = int(line.split()[-1])
total = b.get("+Inf", 0)
over = [total - b.get(le, total) for le in ("0.1", "0.25", "0.5", "1", "2.5")]
print("store calls: %d; slower than 100 ms: %d, 250 ms: %d, 500 ms: %d, 1 s: %d, 2.5 s: %d"
      % tuple([total] + over))
' || echo "store calls: (no metrics)"
  # What the server logged of its store: calls refused by timeout, calls served in their
  # grace (the slowest of them), and the store marked failing.
  local log timeouts slow slowest failing
  log=$(sed 's/\x1b\[[0-9;]*m//g' "$work/server.log")
  timeouts=$(echo "$log" | grep -c "did not answer within [0-9]" || true)
  slow=$(echo "$log" | grep -o " calls=[0-9]* slowest_ms=[0-9]*" || true)
  slowest=$(echo "$slow" | sed -n 's/.*slowest_ms=//p' | sort -n | tail -1)
  failing=$(echo "$log" | grep -c "it counts as failing" || true)
  local served
  served=$(echo "$slow" | awk -F'calls=' 'NF > 1 { split($2, a, " "); s += a[1] } END { print s + 0 }')
  echo "server log: $timeouts store calls refused by timeout; $served calls served in their" \
    "grace (logged at most every 10 s: a lower bound), slowest ${slowest:-none} ms; store" \
    "marked failing $failing times"
  echo
  local last
  last=$(echo "$out" | tail -1)
  local calls refused s503
  calls=$(echo "$last" | sed -n 's/.*calls=\([0-9]*\).*/\1/p')
  refused=$(echo "$last" | sed -n 's/.*refused=\([0-9]*\).*/\1/p')
  s503=$(echo "$last" | sed -n 's/.*status_503=\([0-9]*\).*/\1/p')
  if [ -z "$calls" ] || [ "$calls" = 0 ]; then
    failed=1
    s503="no calls"
  elif [ "$s503" != 0 ]; then
    failed=1
  fi
  rows+=("| $store | $latency | $n | $calls | $refused | $s503 |")
  stop_all
}

echo "spendgate $(git rev-parse --short HEAD)${SPENDGATE_BENCH_BIN:+ (server: $SPENDGATE_BENCH_BIN)}, $(nproc) cores, $(date -u +%FT%TZ), $CLIENTS clients, $SECONDS_EACH s per case"
echo
for n in $(seq "$RUNS"); do
  for c in "${cases[@]}"; do
    run_case "${c%%:*}" "${c##*:}" "$n"
  done
done
echo "| store | upstream ms | run | calls | refused | 503 |"
echo "|---|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"
if [ "$failed" != 0 ]; then
  echo "FAIL: some calls were refused with 503 (or a case did not run)"
  exit 1
fi
echo "OK: no call refused with 503"
