# Shared by the benchmark scripts (sourced): free loopback ports, and the config of a gateway
# whose limits never bind, so that what is measured is the work of admitting, not refusals.

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

BENCH_TOKEN=bench-service-token-0123456789

# bench_config PORT STORE_TOML [EXTRA_TOML]: prints the config.
bench_config() {
  cat <<TOML
[server]
listen = "127.0.0.1:$1"
service_tokens = ["$BENCH_TOKEN"]
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
