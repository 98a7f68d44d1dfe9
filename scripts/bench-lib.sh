# Shared by the benchmark scripts (sourced from the repository's root): the package that builds
# the `spendgate` binary, free loopback ports, and the config of a gateway whose limits never
# bind, so that what is measured is the work of admitting, not refusals.

# The package whose `spendgate` binary is measured: `spendgate-server` before the crate split,
# `spendgate` (crates/spendgate) after it. SERVER_PKG in the environment overrides it.
SERVER_PKG=${SERVER_PKG:-spendgate}

# wait_url URL...: waits (at most 10 s) until every URL answers 2xx; fails otherwise.
wait_url() {
  for _ in $(seq 100); do
    local ok=1 u
    for u in "$@"; do curl -fs "$u" >/dev/null 2>&1 || { ok=0; break; }; done
    [ "$ok" = 1 ] && return 0
    sleep 0.1
  done
  echo "not answering after 10 s: $*" >&2
  return 1
}

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

BENCH_TOKEN=bench-service-token-0123456789
# /metrics is served to the admin token: `curl -H "$BENCH_ADMIN_AUTH" .../metrics`.
BENCH_ADMIN_TOKEN=bench-admin-token-0123456789
BENCH_ADMIN_AUTH="Authorization: Bearer $BENCH_ADMIN_TOKEN"

# bench_config PORT STORE_TOML [EXTRA_TOML]: prints the config.
bench_config() {
  cat <<TOML
[server]
listen = "127.0.0.1:$1"
service_tokens = ["$BENCH_TOKEN"]
admin_tokens = ["$BENCH_ADMIN_TOKEN"]
[sessions]
keys = ["bench-session-key-0123456789abcdef"]
secure_cookie = false
create_rate_per_ip = "100000/second"
create_rate_global = "100000/second"
[store]
$2
[limits.global]
rate = "1000000/second"
burst = 1000000
concurrency = 100000
budgets = [{ amount = "1000000", window = "day" }]
[limits.ip]
rate = "1000000/second"
burst = 1000000
concurrency = 100000
budgets = []
[limits.session]
rate = "1000000/second"
burst = 1000000
concurrency = 100000
budgets = []
[limits.conversation]
concurrency = 100000
budgets = []
[run]
max_tool_calls = 64
max_seconds = 3600
max_cost = "1000000"
[tools.bench_tool]
per_call = "0.000001"
${3:-}
TOML
}

# fsync_floor DIR: the disk's own floor, measured in the same run: `fdatasync` after an
# 8 KiB overwrite in a preallocated file in DIR (what one WAL commit costs at least), 400
# times at ~250/s. Prints a Markdown table row.
fsync_floor() {
  python3 - "$1" <<'PY'
import os, sys, time
path = os.path.join(sys.argv[1], "fsync-floor.bin")
fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
size = 4 << 20
os.pwrite(fd, b"\0" * size, 0)
os.fsync(fd)
lat, off = [], 0
for _ in range(400):
    os.pwrite(fd, os.urandom(8192), off)
    off = (off + 8192) % size
    t = time.perf_counter()
    os.fdatasync(fd)
    lat.append(time.perf_counter() - t)
    time.sleep(0.004)
os.close(fd)
os.unlink(path)
lat.sort()
q = lambda p: lat[min(len(lat) - 1, int(len(lat) * p))] * 1e3
print(f"| disk floor: one `fdatasync` of an 8 KiB overwrite, idle, p50 / p99 / max | {q(0.5):.3f} / {q(0.99):.3f} / {lat[-1]*1e3:.3f} ms |")
PY
}
