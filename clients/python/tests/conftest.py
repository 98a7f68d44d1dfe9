"""A live `spendgate serve` per test, on a free port, with a memory store and a short lease.

The binary is ``$SPENDGATE_BIN`` (the Rust test that runs this suite sets it), else it is
built here with ``cargo build -p spendgate`` at the repository's root.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

import httpx
import pytest

#: The repository (for docs/openapi.json and the build): ``$SPENDGATE_REPO`` when the suite
#: runs from a copy, else the checkout this file is in.
REPO = Path(os.environ.get("SPENDGATE_REPO") or Path(__file__).resolve().parents[3])
SERVICE = "py-client-service-token-0123456789"
ADMIN = "py-client-admin-token-0123456789"
#: The lease of every test server: a killed agent's step expires this long after its last call.
LEASE_TTL_S = 2
#: How long a server may take to listen (seconds on a busy machine: a debug build, loaded cores).
START_WAIT_S = 60.0

#: Prices: gpt-4o-mini at 0.15 / 0.075 (cached) / 0.60 per million tokens; web_search at 0.01
#: a call; fetch at 0.001 a unit.
PRICES = """
[models."gpt-4o-mini"]
upstream = "local"
input_per_million = "0.15"
cached_input_per_million = "0.075"
output_per_million = "0.60"
tokenizer = "bytes"

[tools.web_search]
per_call = "0.01"

[tools.fetch]
per_unit = "0.001"

[upstreams.local]
base_url = "http://127.0.0.1:9/v1"
"""

OPEN = """rate = "100000/second"
burst = 100000
concurrency = 1000
"""

#: Limits that never bind unless a test gives its own section.
DEFAULT_LIMITS: Dict[str, str] = {
    "global": OPEN + 'budgets = [{ amount = "100", window = "day" }]\n',
    "ip": OPEN + "budgets = []\n",
    "session": OPEN + 'budgets = [{ amount = "100", window = "day" }]\n',
    "conversation": "concurrency = 1000\nbudgets = []\n",
}
DEFAULT_RUN = 'max_tool_calls = 100\nmax_model_rounds = 100\nmax_cost = "10"\n'


def _binary() -> Path:
    env = os.environ.get("SPENDGATE_BIN")
    if env:
        p = Path(env)
        if not p.is_file():
            raise RuntimeError(f"SPENDGATE_BIN={env} is not a file")
        return p
    subprocess.run(["cargo", "build", "-p", "spendgate"], cwd=REPO, check=True)
    meta = subprocess.run(
        ["cargo", "metadata", "--format-version", "1", "--no-deps"],
        cwd=REPO, check=True, capture_output=True, text=True,
    )
    return Path(json.loads(meta.stdout)["target_directory"]) / "debug" / "spendgate"


@pytest.fixture(scope="session")
def spendgate_bin() -> Path:
    return _binary()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


#: The `[store]` keys of a test server besides the lease: a memory store.
MEMORY = 'kind = "memory"'


def render_config(port: int, limits: Dict[str, str], run: str, extra: str, store: str) -> str:
    sections = "".join(f"\n[limits.{k}]\n{v}" for k, v in {**DEFAULT_LIMITS, **limits}.items())
    return f"""
[server]
listen = "127.0.0.1:{port}"
service_tokens = ["env:SPENDGATE_SERVICE_TOKEN"]
admin_tokens = ["env:SPENDGATE_ADMIN_TOKEN"]

[sessions]
keys = ["py-client-session-key-0123456789abcdef"]
secure_cookie = false
create_rate_per_ip = "100000/second"
create_rate_global = "100000/second"

[store]
{store}
lease_ttl_s = {LEASE_TTL_S}
{sections}
[run]
{run}
{PRICES}
{extra}
"""


class Server:
    """One `spendgate serve` process (on a Redis store: after `spendgate store init`)."""

    def __init__(
        self, binary: Path, limits: Dict[str, str], run: str, extra: str, store: str = MEMORY
    ) -> None:
        self.dir = tempfile.TemporaryDirectory(prefix="spendgate-py-")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        path = Path(self.dir.name) / "spendgate.toml"
        env = {
            **os.environ,
            "SPENDGATE_SERVICE_TOKEN": SERVICE,
            "SPENDGATE_ADMIN_TOKEN": ADMIN,
            "RUST_LOG": "warn",
        }
        if 'kind = "redis"' in store:
            # as an operator does once for a new Redis deployment: the ledger id to pin
            path.write_text(render_config(self.port, limits, run, extra, store))
            init = subprocess.run(
                [str(binary), "store", "init", "--config", str(path)],
                env=env, capture_output=True, text=True, timeout=120,
            )
            ids = [ln for ln in init.stdout.splitlines() if ln.startswith("ledger_id = ")]
            assert init.returncode == 0 and ids, f"store init: {init.stdout}{init.stderr}"
            store += "\n" + ids[-1]
        path.write_text(render_config(self.port, limits, run, extra, store))
        self.log = open(Path(self.dir.name) / "log", "w+b")
        self.proc = subprocess.Popen(
            [str(binary), "serve", "--config", str(path)],
            env=env, stdout=self.log, stderr=subprocess.STDOUT,
        )
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_WAIT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                if httpx.get(self.url + "/readyz", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        out = self.output()
        self.stop()
        raise RuntimeError(f"spendgate did not start:\n{out}")

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        self.dir.cleanup()

    # -- the admin API, to check what the client did
    def admin(self, method: str, path: str, body: Optional[Dict[str, Any]] = None) -> Any:
        r = httpx.request(
            method, self.url + path, json=body,
            headers={"authorization": f"Bearer {ADMIN}"}, timeout=10,
        )
        assert r.status_code == 200, f"{method} {path}: {r.status_code} {r.text}"
        return r.json()

    def reservations(self, state: str) -> List[Dict[str, Any]]:
        rows: List[Dict[str, Any]] = self.admin(
            "GET", f"/admin/v1/reservations?state={state}&limit=1000"
        )["reservations"]
        return rows

    def reservation(self, step_id: str) -> Optional[Dict[str, Any]]:
        for state in ("held", "committed", "released", "unknown", "expired"):
            for row in self.reservations(state):
                if row["id"] == step_id:
                    return row
        return None


StartServer = Callable[..., Server]


def _starter(spendgate_bin: Path) -> Iterator[StartServer]:
    """``start_server(limits={"session": "..."}, run="...", extra="...")``: a live server."""
    started: List[Server] = []

    def start(
        limits: Optional[Dict[str, str]] = None,
        run: str = DEFAULT_RUN,
        extra: str = "",
        store: str = MEMORY,
    ) -> Server:
        s = Server(spendgate_bin, limits or {}, run, extra, store)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


@pytest.fixture
def start_server(spendgate_bin: Path) -> Iterator[StartServer]:
    """A server of the test's own (limits that bind, a cutoff): stopped after the test."""
    yield from _starter(spendgate_bin)


@pytest.fixture(scope="module")
def server(spendgate_bin: Path) -> Iterator[Server]:
    """A server shared by a module's tests (the machine may take seconds to start one): each
    test uses guest sessions of its own and checks its session's scope, never the global one."""
    for start in _starter(spendgate_bin):
        yield start()


@pytest.fixture
def python() -> str:
    return sys.executable


#: Where the store-failure test finds a Redis server (scripts/test.sh installs it).
REDIS_SERVER = os.environ.get("SPENDGATE_REDIS_SERVER", "redis-server")


class Redis:
    """A private `redis-server` on a free loopback port, without persistence."""

    def __init__(self) -> None:
        self.dir = tempfile.TemporaryDirectory(prefix="spendgate-py-redis-")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        try:
            self.proc = subprocess.Popen(
                [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", self.dir.name],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
        except FileNotFoundError:
            raise RuntimeError(
                f"no {REDIS_SERVER} (the store-failure test needs one): apt-get install "
                "redis-server, or set SPENDGATE_REDIS_SERVER"
            ) from None
        deadline = time.monotonic() + START_WAIT_S
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.dir.cleanup()


@pytest.fixture
def redis() -> Iterator[Redis]:
    r = Redis()
    yield r
    r.stop()
