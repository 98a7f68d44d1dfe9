#!/usr/bin/env bash
# Redis server instructions per ledger call, machine-independent (this host's timings are
# noisy; instruction counts are not): runs `examples/opcount` against a private redis-server
# under `valgrind --tool=callgrind`, one dump per phase, and prints a Markdown table of
# instructions per call, the last row a trivial `FCALL` on the same server (the baseline that
# `scripts/bench.sh` reports a reserve+commit pair against). With two opcount binaries (an A/B of two builds), each runs on a
# server of its own and the table has a column for each.
#
#   scripts/opcount.sh [RUNS] [POLICY] [STEPS] [OPCOUNT_BIN ...]
#
# RUNS (default 100) runs of STEPS tool steps (default 4) and a model step each; POLICY `bench`
# or `full` (see opcount.rs). Without a binary, this tree's is built. Needs valgrind.
# OPCOUNT_REDIS: the redis-server to run (a build with symbols lets `callgrind_annotate` split
# the Lua interpreter's share); OPCOUNT_KEEP=DIR keeps the callgrind dumps in DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-100}
POLICY=${2:-bench}
STEPS=${3:-4}
shift $(( $# < 3 ? $# : 3 ))
bins=("$@")
if [ ${#bins[@]} = 0 ]; then
  cargo build --release -q -p spendgate-redis --example opcount
  bins=(./target/release/examples/opcount)
fi
command -v valgrind >/dev/null || { echo "opcount.sh needs valgrind (apt-get install valgrind)" >&2; exit 1; }
. scripts/bench-lib.sh
dir=$(mktemp -d)
vpid=
cleanup() { [ -n "$vpid" ] && kill "$vpid" 2>/dev/null; wait 2>/dev/null || true; rm -rf "$dir"; }
trap cleanup EXIT
[ -n "${OPCOUNT_KEEP:-}" ] && mkdir -p "$OPCOUNT_KEEP"
TRIVIAL_CALLS=2000
TRIVIAL_LIB=$'#!lua name=benchtrivial\nredis.register_function("bench_trivial", function() return 1 end)'

# count BIN OUT: instructions per call of each phase of one opcount run, as "phase value" lines
count() {
  local bin=$1 out=$2 port
  port=$(free_port)
  mkdir -p "$out"
  (cd "$out" && exec valgrind --tool=callgrind --callgrind-out-file="$out/cg.%p" \
    "${OPCOUNT_REDIS:-redis-server}" --port "$port" --bind 127.0.0.1 --save "" --appendonly no --dir "$out" \
    > "$out/redis.log" 2>&1) &
  vpid=$!
  for _ in $(seq 300); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done
  OPCOUNT_URL="redis://127.0.0.1:$port/0" OPCOUNT_PID=$vpid "$bin" "$RUNS" "$POLICY" opcount "$STEPS" > "$out/phases" 2> "$out/opcount.log"
  # The baseline on the same server: a trivial `FCALL` (a function that returns 1), called
  # TRIVIAL_CALLS times one after the other on one connection, as the store calls are.
  redis-cli -p "$port" function load replace "$TRIVIAL_LIB" >/dev/null
  callgrind_control -z "$vpid" >/dev/null 2>&1 || { echo "callgrind_control -z failed" >&2; exit 1; }
  redis-cli -p "$port" -r "$TRIVIAL_CALLS" fcall bench_trivial 0 >/dev/null
  callgrind_control -d opcount-fcall_trivial "$vpid" >/dev/null 2>&1 \
    || { echo "callgrind_control -d failed" >&2; exit 1; }
  echo "phase opcount-fcall_trivial $TRIVIAL_CALLS" >> "$out/phases"
  kill "$vpid"; wait "$vpid" 2>/dev/null || true; vpid=
  while read -r _ name calls; do
    # the dump named after the phase: its total instructions over the phase's calls
    local f total
    f=$(grep -l "^desc: Trigger: .*$name\$" "$out"/cg.* | head -1)
    total=$(awk '/^(summary|totals):/ {print $2; exit}' "$f")
    echo "${name#opcount-} $(( total / calls ))"
  done < "$out/phases"
}

i=0
for b in "${bins[@]}"; do
  count "$b" "$dir/$i" > "$dir/table.$i"
  [ -n "${OPCOUNT_KEEP:-}" ] && cp -r "$dir/$i" "$OPCOUNT_KEEP/$i"
  i=$((i + 1))
done
echo "Redis server instructions per call (callgrind; $RUNS runs of $STEPS tool steps, policy $POLICY)"
echo
header="| phase |"; rule="|---|"
for b in "${bins[@]}"; do header="$header $b |"; rule="$rule---|"; done
echo "$header"; echo "$rule"
cut -d' ' -f1 "$dir/table.0" | while read -r phase; do
  row="| $phase |"
  for j in $(seq 0 $((i - 1))); do
    row="$row $(awk -v p="$phase" '$1 == p {printf "%.1fk", $2 / 1000}' "$dir/table.$j") |"
  done
  echo "$row"
done
