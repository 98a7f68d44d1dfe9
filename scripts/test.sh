#!/usr/bin/env bash
# The whole test suite, on a fresh Debian machine with Rust: installs what the tests need
# (redis-server for the tests that start their own Redis, and a Valkey server; PostgreSQL's
# server binaries for the history's tests; Chromium and its driver for the
# page test; a Python virtualenv with the official `openai` package for the proxy's
# real-client tests and `selenium` for the page test; httpx and pytest for the Python client,
# Node and npm for the TypeScript client and the TypeScript reference agent), then checks
# formatting and lints and runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
apt_updated=0
apt_install() {
  if [ "$apt_updated" = 0 ]; then as_root apt-get update -qq; apt_updated=1; fi
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@"
}

command -v redis-server >/dev/null 2>&1 || apt_install redis-server
# PostgreSQL's server binaries (initdb, postgres), for the tests that start their own PostgreSQL
# (the Redis ledger's history drained into it); the tests never use the system's server.
compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null || apt_install postgresql
# openssl, to make the certificates of the test of Redis over TLS.
command -v openssl >/dev/null 2>&1 || apt_install openssl
# curl and jq, for README's walkthrough (crates/spendgate-testkit/tests/readme.rs runs it).
command -v curl >/dev/null 2>&1 || apt_install curl
command -v jq >/dev/null 2>&1 || apt_install jq
# Valkey, for the conformance suite on Valkey: unpacked under .valkey/ from Debian's
# valkey-tools package (bookworm-backports here), nothing installed.
export SPENDGATE_VALKEY_SERVER
SPENDGATE_VALKEY_SERVER=$(scripts/fetch-valkey.sh)
command -v python3 >/dev/null 2>&1 || apt_install python3 python3-venv
# A real browser for the test of the demo page and the dashboard.
{ command -v chromium && command -v chromedriver; } >/dev/null 2>&1 || apt_install chromium chromium-driver

# The official OpenAI and Anthropic Python clients, for tests that drive the proxy with them;
# Selenium, for the page test (given the browser and driver paths, it downloads nothing).
VENV=.venv
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV" 2>/dev/null || { apt_install python3-venv; python3 -m venv "$VENV"; }
fi
"$VENV/bin/python" -c 'import openai, selenium, anthropic' 2>/dev/null \
  || "$VENV/bin/pip" install -q 'openai>=1.40,<3' 'selenium>=4.20,<5' 'anthropic>=0.40,<1'
# schemathesis, which the API document's test runs against a live server (pinned: its CLI
# and checks change between releases).
"$VENV/bin/python" -c 'import schemathesis' 2>/dev/null \
  || "$VENV/bin/pip" install -q 'schemathesis==4.32.5'
# The Python client's tests (clients/python, run by crates/spendgate/tests/it/clients.rs):
# httpx and pytest, and setuptools and wheel to pip-install the client from the repository
# without fetching a build backend.
"$VENV/bin/python" -c 'import httpx, pytest, setuptools, wheel' 2>/dev/null \
  || "$VENV/bin/pip" install -q 'httpx>=0.24,<1' 'pytest>=7' 'setuptools>=61' wheel
export SPENDGATE_TEST_PYTHON="$PWD/$VENV/bin/python"

# The TypeScript client's tests (clients/typescript): Node 20 or later with npm, and its dev
# dependencies from package-lock.json (again only when the lock file changed).
command -v npm >/dev/null 2>&1 || apt_install nodejs npm
if ! cmp -s clients/typescript/package-lock.json clients/typescript/node_modules/.spendgate-lock; then
  (cd clients/typescript && npm ci --no-audit --no-fund --silent \
    && cp package-lock.json node_modules/.spendgate-lock)
fi
# The TypeScript reference agent (examples/typescript-agent, run by
# crates/spendgate/tests/it/agents.rs): the official `openai` package, and the client above
# (linked; its dist/ was built by its `npm ci`).
if ! cmp -s examples/typescript-agent/package-lock.json examples/typescript-agent/node_modules/.spendgate-lock; then
  (cd examples/typescript-agent && npm ci --no-audit --no-fund --silent \
    && cp package-lock.json node_modules/.spendgate-lock)
fi

rustup component list --installed 2>/dev/null | grep -q rustfmt || rustup component add rustfmt clippy || true

# cargo-deny, for the licenses and bans of every dependency (deny.toml; both checks work offline).
command -v cargo-deny >/dev/null 2>&1 || cargo install --locked cargo-deny@0.20.2

cargo fmt --all -- --check
cargo deny check licenses bans
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo test --workspace --locked
