#!/usr/bin/env bash
# Same-run A/B of two `spendgate` binaries on the decision API: each round starts each binary
# in turn and drives it with `spendgate-load`, so the machine's drift hits both alike.
# - STORE sqlite (default): a fresh file per run, open loop only (`--open-only`) at RATE
#   pairs/s for SECONDS. Prints per run: reserve p50 / p99 / max, then pair-from-schedule
#   p50 / p99 / max.
# - STORE redis: one private redis-server, a fresh key prefix per run, the open loop then the
#   closed loop. Prints per run: closed-loop pairs/s, then reserve p50 / p99 / max.
#
#   scripts/bench-ab.sh BIN_A BIN_B [ROUNDS] [RATE] [SECONDS] [STORE]
# (e.g. copy target/release/spendgate aside, change the code, rebuild, compare.)
set -euo pipefail
cd "$(dirname "$0")/.."
A=$1; B=$2; ROUNDS=${3:-3}; RATE=${4:-1000}; SECONDS_EACH=${5:-5}; STORE=${6:-sqlite}
cargo build --release -q -p spendgate-bench --bin spendgate-load
. scripts/bench-lib.sh
dir=$(mktemp -d)
rpid=
trap '[ -n "$rpid" ] && kill $rpid 2>/dev/null; wait 2>/dev/null; rm -rf "$dir"' EXIT
case $STORE in
  sqlite) load_opts=(--open-only); lines="reserve latency|pair latency" ;;
  redis)
    rport=$(free_port)
    redis-server --port "$rport" --bind 127.0.0.1 --save "" --appendonly no --dir "$dir" \
      --daemonize no > "$dir/redis.log" 2>&1 &
    rpid=$!
    for _ in $(seq 50); do redis-cli -p "$rport" ping >/dev/null 2>&1 && break; sleep 0.1; done
    load_opts=(--concurrency 32 --runs 64); lines="pairs closed-loop|reserve latency" ;;
  *) echo "STORE is sqlite or redis" >&2; exit 2 ;;
esac
n=0
one() {
  local bin=$1 port pid out
  n=$((n + 1)); port=$(free_port)
  if [ "$STORE" = sqlite ]; then
    store="kind = \"sqlite\"
path = \"$dir/bench$n.db\""
  else
    store="kind = \"redis\"
url = \"redis://127.0.0.1:$rport/0\"
prefix = \"ab$n\"
timeout_ms = 1000"
  fi
  bench_config "$port" "$store" > "$dir/bench$n.toml"
  # (builds before `store init` initialised a new prefix themselves; builds with ledger ids
  # print the `ledger_id = ...` line to pin, and take a witness path)
  if [ "$STORE" = redis ]; then
    pin=$("$bin" store init --config "$dir/bench$n.toml" 2>/dev/null | grep '^ledger_id = ' || true)
    [ -n "$pin" ] && bench_config "$port" "$store
$pin
witness_path = \"$dir/bench$n.witness\"" > "$dir/bench$n.toml"
  fi
  "$bin" serve --config "$dir/bench$n.toml" > "$dir/server$n.log" 2>&1 & pid=$!
  wait_url "http://127.0.0.1:$port/readyz"
  out=$(./target/release/spendgate-load --base "http://127.0.0.1:$port" --service-token "$BENCH_TOKEN" \
    --rate "$RATE" --seconds "$SECONDS_EACH" "${load_opts[@]}" 2>&1 || true)
  echo "$bin: $(echo "$out" | grep -E "$lines" | cut -d'|' -f3 | tr '\n' ' ')"
  kill $pid 2>/dev/null; wait $pid 2>/dev/null || true
}
for _ in $(seq "$ROUNDS"); do one "$A"; one "$B"; done
