// A live `spendgate serve` for a test, on a free port, with a memory store and a short lease.
// The binary is $SPENDGATE_BIN (the Rust test that runs this suite sets it), else it is built
// here with `cargo build -p spendgate` at the repository's root.

import { execFileSync, spawn, type ChildProcess } from "node:child_process";
import { mkdtempSync, rmSync, writeFileSync, existsSync } from "node:fs";
import { connect, createServer } from "node:net";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

export const SERVICE = "ts-client-service-token-0123456789";
export const ADMIN = "ts-client-admin-token-0123456789";
/** The lease of every test server: a killed agent's step expires this long after its last call. */
export const LEASE_TTL_S = 2;
/** How long a server may take to answer `/readyz`. */
const START_WAIT_MS = 60_000;

// build/test/server.js -> the repository's root
const here = dirname(fileURLToPath(import.meta.url));
export const REPO = resolve(here, "../../../..");

const PRICES = `
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
`;

const OPEN = 'rate = "100000/second"\nburst = 100000\nconcurrency = 1000\n';
export const DEFAULT_LIMITS: Record<string, string> = {
  global: OPEN + 'budgets = [{ amount = "100", window = "day" }]\n',
  ip: OPEN + "budgets = []\n",
  session: OPEN + 'budgets = [{ amount = "100", window = "day" }]\n',
  conversation: "concurrency = 1000\nbudgets = []\n",
};
export const DEFAULT_RUN = 'max_tool_calls = 100\nmax_model_rounds = 100\nmax_cost = "10"\n';

let binary: string | undefined;

function spendgateBinary(): string {
  if (binary !== undefined) return binary;
  const env = process.env.SPENDGATE_BIN;
  if (env) {
    if (!existsSync(env)) throw new Error(`SPENDGATE_BIN=${env} does not exist`);
    binary = env;
    return env;
  }
  execFileSync("cargo", ["build", "-p", "spendgate"], { cwd: REPO, stdio: "inherit" });
  const meta = JSON.parse(
    execFileSync("cargo", ["metadata", "--format-version", "1", "--no-deps"], { cwd: REPO, encoding: "utf8" }),
  ) as { target_directory: string };
  binary = join(meta.target_directory, "debug", "spendgate");
  return binary;
}

function freePort(): Promise<number> {
  return new Promise((ok, fail) => {
    const s = createServer();
    s.once("error", fail);
    s.listen(0, "127.0.0.1", () => {
      const addr = s.address();
      const port = typeof addr === "object" && addr !== null ? addr.port : 0;
      s.close(() => ok(port));
    });
  });
}

export interface ServerOptions {
  limits?: Record<string, string>;
  run?: string;
  /** `[store]` keys besides the lease (default: a memory store); a Redis store is initialised
   * first with `spendgate store init`, as an operator does, and pinned to its ledger id. */
  store?: string;
}

export class Server {
  private constructor(
    readonly url: string,
    private readonly proc: ChildProcess,
    private readonly dir: string,
    private readonly log: () => string,
  ) {}

  static async start(opts: ServerOptions = {}): Promise<Server> {
    const port = await freePort();
    const dir = mkdtempSync(join(tmpdir(), "spendgate-ts-"));
    const limits = { ...DEFAULT_LIMITS, ...(opts.limits ?? {}) };
    const sections = Object.entries(limits)
      .map(([k, v]) => `\n[limits.${k}]\n${v}`)
      .join("");
    const env = { ...process.env, SPENDGATE_SERVICE_TOKEN: SERVICE, SPENDGATE_ADMIN_TOKEN: ADMIN, RUST_LOG: "warn" };
    const path = join(dir, "spendgate.toml");
    let store = opts.store ?? 'kind = "memory"';
    const render = () => `
[server]
listen = "127.0.0.1:${port}"
service_tokens = ["env:SPENDGATE_SERVICE_TOKEN"]
admin_tokens = ["env:SPENDGATE_ADMIN_TOKEN"]

[sessions]
keys = ["ts-client-session-key-0123456789abcdef"]
secure_cookie = false
create_rate_per_ip = "100000/second"
create_rate_global = "100000/second"

[store]
${store}
lease_ttl_s = ${LEASE_TTL_S}
${sections}
[run]
${opts.run ?? DEFAULT_RUN}
${PRICES}
`;
    if (store.includes('kind = "redis"')) {
      writeFileSync(path, render());
      const out = execFileSync(spendgateBinary(), ["store", "init", "--config", path], { env, encoding: "utf8" });
      const id = out.split("\n").filter((l) => l.startsWith("ledger_id = ")).pop();
      if (!id) throw new Error(`store init printed no ledger id: ${out}`);
      store += `\n${id}`;
    }
    writeFileSync(path, render());
    const proc = spawn(spendgateBinary(), ["serve", "--config", path], {
      env,
      stdio: ["ignore", "pipe", "pipe"],
    });
    let out = "";
    proc.stdout?.on("data", (d: Buffer) => (out += d.toString()));
    proc.stderr?.on("data", (d: Buffer) => (out += d.toString()));
    const url = `http://127.0.0.1:${port}`;
    const s = new Server(url, proc, dir, () => out);
    const deadline = Date.now() + START_WAIT_MS;
    while (Date.now() < deadline && proc.exitCode === null) {
      try {
        if ((await fetch(`${url}/readyz`)).status === 200) return s;
      } catch {
        // not listening yet
      }
      await new Promise((r) => setTimeout(r, 50));
    }
    await s.stop();
    throw new Error(`spendgate did not start:\n${out}`);
  }

  output(): string {
    return this.log();
  }

  async stop(): Promise<void> {
    if (this.proc.exitCode === null && this.proc.signalCode === null) {
      const exited = new Promise((r) => this.proc.once("exit", r));
      this.proc.kill("SIGTERM");
      await Promise.race([exited, new Promise((r) => setTimeout(r, 10_000))]);
      if (this.proc.exitCode === null && this.proc.signalCode === null) this.proc.kill("SIGKILL");
    }
    rmSync(this.dir, { recursive: true, force: true });
  }

  async admin(method: string, path: string, body?: unknown): Promise<any> {
    const init: RequestInit = { method, headers: { authorization: `Bearer ${ADMIN}`, "content-type": "application/json" } };
    if (body !== undefined) init.body = JSON.stringify(body);
    const r = await fetch(this.url + path, init);
    const text = await r.text();
    if (r.status !== 200) throw new Error(`${method} ${path}: ${r.status} ${text}`);
    return JSON.parse(text);
  }

  async reservations(state: string): Promise<Array<Record<string, any>>> {
    return (await this.admin("GET", `/admin/v1/reservations?state=${state}&limit=1000`)).reservations;
  }

  async reservation(stepId: string): Promise<Record<string, any> | undefined> {
    for (const state of ["held", "committed", "released", "unknown", "expired"]) {
      const row = (await this.reservations(state)).find((r) => r.id === stepId);
      if (row) return row;
    }
    return undefined;
  }

  async waitForState(stepId: string, state: string, limitMs = 15_000): Promise<Record<string, any>> {
    const deadline = Date.now() + limitMs;
    let row: Record<string, any> | undefined;
    while (Date.now() < deadline) {
      row = await this.reservation(stepId);
      if (row?.state === state) return row;
      await new Promise((r) => setTimeout(r, 100));
    }
    throw new Error(`step ${stepId} not ${state} after ${limitMs} ms: ${JSON.stringify(row)}`);
  }
}

/** A private `redis-server` on a free loopback port, without persistence
 * (`$SPENDGATE_REDIS_SERVER`, else `redis-server` on PATH; scripts/test.sh installs it). */
export class Redis {
  private constructor(
    readonly url: string,
    private readonly proc: ChildProcess,
    private readonly dir: string,
  ) {}

  static async start(): Promise<Redis> {
    const port = await freePort();
    const dir = mkdtempSync(join(tmpdir(), "spendgate-ts-redis-"));
    const bin = process.env.SPENDGATE_REDIS_SERVER || "redis-server";
    const proc = spawn(bin, ["--port", String(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", dir], {
      stdio: "ignore",
    });
    const failed = new Promise<Error>((ok) =>
      proc.once("error", () =>
        ok(new Error(`no ${bin} (the store-failure test needs one): apt-get install redis-server, or set SPENDGATE_REDIS_SERVER`)),
      ),
    );
    const r = new Redis(`redis://127.0.0.1:${port}/0`, proc, dir);
    const deadline = Date.now() + START_WAIT_MS;
    while (Date.now() < deadline) {
      const up = await Promise.race([
        failed,
        new Promise<boolean>((ok) => {
          const c = connect(port, "127.0.0.1", () => (c.end(), ok(true)));
          c.once("error", () => ok(false));
        }),
      ]);
      if (up instanceof Error) throw up;
      if (up) return r;
      await new Promise((res) => setTimeout(res, 50));
    }
    await r.stop();
    throw new Error("redis-server did not start");
  }

  async stop(): Promise<void> {
    if (this.proc.exitCode === null && this.proc.signalCode === null) {
      const exited = new Promise((r) => this.proc.once("exit", r));
      this.proc.kill("SIGKILL");
      await exited;
    }
    rmSync(this.dir, { recursive: true, force: true });
  }
}
