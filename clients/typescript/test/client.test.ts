// The client against a live spendgate.

import { spawn } from "node:child_process";
import { createInterface } from "node:readline";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import assert from "node:assert/strict";
import { after, before, describe, it } from "node:test";

import {
  BudgetExhausted,
  BudgetHeld,
  Client,
  ConcurrencyLimited,
  ContextTooLarge,
  CutoffEngaged,
  ModelNotAllowed,
  PayloadTooLarge,
  RateLimited,
  ReservationClosed,
  RunBoundExceeded,
  SpendgateRefusal,
  StoreUnavailable,
  type Run,
  type UsageAnswer,
  type UsageScope,
} from "../src/index.js";
import { LEASE_TTL_S, Redis, SERVICE, Server } from "./server.js";

const IP = "203.0.113.7";
const MODEL = "gpt-4o-mini";
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

function scope(u: UsageAnswer, kind: string, window?: string): UsageScope {
  const s = u.scopes.find((x) => x.kind === kind && (window === undefined || x.window === window));
  assert.ok(s, `no ${kind} scope in ${JSON.stringify(u)}`);
  return s;
}

async function guest(sg: Client): Promise<string> {
  return (await sg.session({ clientIp: IP })).session;
}

function isRefusal(status: number, code: string, sc: string | null) {
  return (e: unknown) => {
    assert.ok(e instanceof SpendgateRefusal, `not a refusal: ${String(e)}`);
    assert.deepEqual([e.status, e.code, e.scope], [status, code, sc]);
    return true;
  };
}

describe("a shared server", () => {
  let server: Server;
  let sg: Client;
  before(async () => {
    server = await Server.start();
    sg = new Client({ baseUrl: server.url, serviceToken: SERVICE });
  });
  after(async () => server?.stop());

  it("charges a multi-step run to the micro", async () => {
    const session = await guest(sg);
    let total = 0;
    let finishedRun: Run | undefined;
    {
      await using run = await sg.run({ session, clientIp: IP, conversation: "c1", inputText: "hi" });
      assert.match(run.runId, /^run_/);
      assert.equal(run.bounds.max_output_tokens, 1024);
      {
        await using s1 = await run.modelStep({ model: MODEL, promptTokens: 1200, maxOutputTokens: 400 });
        assert.deepEqual([s1.reservedMicros, s1.maxOutputTokens], [420, 400]);
        // OpenAI's Chat Completions usage: 800 uncached, 400 cached, 300 out
        const r = await s1.commit({ prompt_tokens: 1200, completion_tokens: 300, prompt_tokens_details: { cached_tokens: 400 } });
        assert.deepEqual([r.state, r.charged_micros], ["committed", 120 + 30 + 180]);
        total += r.charged_micros;
        assert.equal((await s1.commit({ prompt_tokens: 1200, completion_tokens: 300 })).repeated, true);
      }
      {
        await using s2 = await run.modelStep({ model: MODEL, promptTokens: 2000, maxOutputTokens: 50 });
        // the AI SDK's usage
        const r = await s2.commit({ inputTokens: 2000, outputTokens: 10 });
        assert.equal(r.charged_micros, 300 + 6);
        total += r.charged_micros;
      }
      const r3 = await run.withToolStep({ tool: "web_search" }, async (s) => {
        assert.equal(s.maxOutputTokens, null);
        return s.commitUnits(1);
      });
      assert.equal(r3.charged_micros, 10_000);
      const r4 = await run.withToolStep({ tool: "fetch", units: 5 }, (s) => s.commitUnits(3));
      assert.equal(r4.charged_micros, 3_000);
      const r5 = await run.withToolStep({ tool: "web_search" }, (s) => s.release());
      assert.deepEqual([r5.state, r5.charged_micros], ["released", 0]);
      total += 13_000;
      // leaving the block finishes the run
      finishedRun = run;
    }
    assert.equal(total, 330 + 306 + 13_000);
    assert.deepEqual([finishedRun?.finished?.state, finishedRun?.finished?.charged_micros], ["finished", total]);
    const u = await sg.usage({ session, clientIp: IP, conversation: "c1" });
    assert.deepEqual([...new Set(u.scopes.map((s) => s.kind))].sort(), ["global", "session"]);
    const s = scope(u, "session");
    assert.deepEqual([s.used_micros, s.reserved_micros, s.limit_micros], [total, 0, 100_000_000]);
    assert.equal(s.remaining_micros, s.limit_micros - total);
  });

  it("marks a step unknown, charged in full, when its work throws (withRun, withModelStep)", async () => {
    const session = await guest(sg);
    let stepId = "";
    let runRef: Run | undefined;
    await assert.rejects(
      sg.withRun({ session, clientIp: IP, conversation: "c2", inputText: "hi" }, async (run) => {
        runRef = run;
        await run.withModelStep({ model: MODEL, promptTokens: 1000, maxOutputTokens: 100 }, async (step) => {
          stepId = step.stepId;
          throw new Error("the model call failed midway");
        });
      }),
      /failed midway/,
    );
    const row = await server.reservation(stepId);
    assert.deepEqual([row?.state, row?.charged_micros], ["unknown", 210]);
    assert.equal(runRef?.finished?.charged_micros, 210);
    const s = scope(await sg.usage({ session }), "session");
    assert.deepEqual([s.used_micros, s.reserved_micros], [210, 0]);
  });

  it("marks a step unknown when an await using block throws", async () => {
    const session = await guest(sg);
    let stepId = "";
    await assert.rejects(async () => {
      await using run = await sg.run({ session, clientIp: IP, conversation: "c3", inputText: "hi" });
      await using step = await run.toolStep({ tool: "web_search" });
      stepId = step.stepId;
      throw new Error("boom");
    }, /boom/);
    const row = await server.reservation(stepId);
    assert.deepEqual([row?.state, row?.charged_micros], ["unknown", 10_000]);
  });

  it("marks a step left without commit unknown, and warns", async () => {
    const warnings: string[] = [];
    const quiet = new Client({ baseUrl: server.url, serviceToken: SERVICE, onWarning: (m) => warnings.push(m) });
    const session = await guest(quiet);
    let stepId = "";
    {
      await using run = await quiet.run({ session, clientIp: IP, conversation: "c4", inputText: "hi" });
      await using step = await run.toolStep({ tool: "web_search" });
      stepId = step.stepId;
    }
    assert.equal(warnings.length, 1);
    assert.match(warnings[0] ?? "", /neither commit nor release/);
    const row = await server.reservation(stepId);
    assert.deepEqual([row?.state, row?.charged_micros], ["unknown", 10_000]);
  });

  it("keeps a held step alive with the heartbeat", async () => {
    const session = await guest(sg);
    await sg.withRun({ session, clientIp: IP, conversation: "c5", inputText: "hi" }, async (run) => {
      await using step = await run.modelStep({ model: MODEL, promptTokens: 1000, maxOutputTokens: 100 });
      await sleep(LEASE_TTL_S * 2500);
      assert.equal((await server.reservation(step.stepId))?.state, "held");
      const r = await step.commit({ prompt_tokens: 1000, completion_tokens: 100 });
      assert.deepEqual([r.state, r.charged_micros], ["committed", 210]);
    });
  });

  it("lets a step without heartbeat expire, and refuses its commit", async () => {
    const session = await guest(sg);
    const run = await sg.run({ session, clientIp: IP, conversation: "c6", inputText: "hi" });
    const step = await run.modelStep({ model: MODEL, promptTokens: 1000, maxOutputTokens: 100 });
    // a client that lost its heartbeat: no call on the run
    await (run as unknown as { unhold(): Promise<void> }).unhold();
    const row = await server.waitForState(step.stepId, "expired");
    assert.equal(row.charged_micros, 210);
    await assert.rejects(step.commit({ prompt_tokens: 10, completion_tokens: 1 }), ReservationClosed);
  });

  it("retries a lost answer with the same Idempotency-Key, holding once", async () => {
    const seen: Array<{ path: string; key: string | null }> = [];
    const dropFirst: typeof fetch = async (input, init) => {
      const r = await fetch(input, init);
      const url = new URL(String(input));
      const key = new Headers(init?.headers).get("idempotency-key");
      const first = !seen.some((s) => s.path === url.pathname);
      seen.push({ path: url.pathname, key });
      if (first && init?.method === "POST" && url.pathname !== "/v1/sessions") {
        await r.arrayBuffer();
        throw new TypeError("fetch failed: connection reset after the request left");
      }
      return r;
    };
    const flaky = new Client({ baseUrl: server.url, serviceToken: SERVICE, fetch: dropFirst });
    const session = await guest(flaky);
    await flaky.withRun({ session, clientIp: IP, conversation: "c7", inputText: "hi" }, async (run) => {
      await run.withModelStep({ model: MODEL, promptTokens: 1000, maxOutputTokens: 100 }, async (step) => {
        assert.equal(scope(await flaky.usage({ session }), "session").reserved_micros, 210, "held once");
        return step.commit({ prompt_tokens: 1000, completion_tokens: 50 });
      });
    });
    const creations = seen.filter((s) => s.path === "/v1/runs" || s.path.endsWith("/steps"));
    assert.equal(creations.length, 4);
    for (const path of new Set(creations.map((c) => c.path))) {
      const keys = creations.filter((c) => c.path === path).map((c) => c.key);
      assert.equal(keys.length, 2);
      assert.ok(keys[0] && keys[0] === keys[1], JSON.stringify(keys));
    }
    const s = scope(await flaky.usage({ session }), "session");
    assert.deepEqual([s.used_micros, s.reserved_micros], [180, 0]);
  });

  it("charges a killed agent's held step in full when its lease expires", async () => {
    const agentJs = join(dirname(fileURLToPath(import.meta.url)), "agent.js");
    const agent = spawn(process.execPath, [agentJs, server.url, SERVICE], { stdio: ["ignore", "pipe", "pipe"] });
    let stderr = "";
    agent.stderr.on("data", (d: Buffer) => (stderr += d.toString()));
    try {
      const lines = createInterface({ input: agent.stdout });
      const first = await new Promise<string>((ok, fail) => {
        lines.once("line", ok);
        agent.once("exit", () => fail(new Error(`the agent exited: ${stderr}`)));
      });
      const held = JSON.parse(first) as { session: string; step_id: string; reserved_micros: number };
      // alive, its heartbeat keeps the step held past the lease
      await sleep(LEASE_TTL_S * 2500);
      assert.equal((await server.reservation(held.step_id))?.state, "held");
      const exited = new Promise((r) => agent.once("exit", r));
      agent.kill("SIGKILL");
      await exited;
      const row = await server.waitForState(held.step_id, "expired", LEASE_TTL_S * 1000 + 10_000);
      assert.equal(row.charged_micros, row.reserved_micros);
      assert.equal(row.charged_micros, held.reserved_micros);
      assert.equal(held.reserved_micros, 210);
      assert.ok((await server.reservations("expired")).some((r) => r.id === held.step_id));
      const s = scope(await sg.usage({ session: held.session }), "session");
      assert.deepEqual([s.used_micros, s.reserved_micros], [210, 0]);
    } finally {
      if (agent.exitCode === null && agent.signalCode === null) agent.kill("SIGKILL");
    }
  });
});

describe("budget refusals", () => {
  let server: Server;
  before(async () => {
    server = await Server.start({
      limits: { session: 'rate = "100000/second"\nburst = 100000\nconcurrency = 1000\nbudgets = [{ amount = "0.0003", window = "day" }]\n' },
    });
  });
  after(async () => server?.stop());

  it("throws BudgetHeld and BudgetExhausted with their fields", async () => {
    const sg = new Client({ baseUrl: server.url, serviceToken: SERVICE });
    const session = await guest(sg);
    await using run = await sg.run({ session, clientIp: IP, conversation: "b", inputText: "hi" });
    {
      await using held = await run.modelStep({ model: MODEL, promptTokens: 1000, maxOutputTokens: 100 });
      assert.equal(held.reservedMicros, 210);
      await assert.rejects(run.modelStep({ model: MODEL, promptTokens: 1000, maxOutputTokens: 100 }), (e) => {
        assert.ok(e instanceof BudgetHeld);
        assert.ok((e.retryAfterS ?? 0) >= 1);
        return isRefusal(429, "budget_held", "session")(e);
      });
      await held.commit({ prompt_tokens: 1000, completion_tokens: 100 });
    }
    await assert.rejects(run.modelStep({ model: MODEL, promptTokens: 1000, maxOutputTokens: 100 }), (e) => {
      assert.ok(e instanceof BudgetExhausted);
      assert.ok(e.retryAfterS !== null && e.retryAfterS > 0 && e.retryAfterS <= 86_400);
      assert.ok(e.ledgerSeq !== null);
      return isRefusal(429, "budget_exhausted", "session")(e);
    });
  });
});

describe("rate, concurrency, run bound and cutoff refusals", () => {
  let server: Server;
  before(async () => {
    server = await Server.start({
      limits: {
        session: 'rate = "1/minute"\nburst = 1\nconcurrency = 1000\nbudgets = []\n',
        conversation: "concurrency = 1\nbudgets = []\n",
      },
      run: 'max_tool_calls = 1\nmax_input_bytes = 100\nmax_cost = "10"\n',
    });
  });
  after(async () => server?.stop());

  it("throws each refusal's own class with its fields", async () => {
    const sg = new Client({ baseUrl: server.url, serviceToken: SERVICE });
    const [a, b, c] = [await guest(sg), await guest(sg), await guest(sg)];
    {
      await using run = await sg.run({ session: a, clientIp: IP, conversation: "shared", inputText: "hi" });
      await assert.rejects(sg.run({ session: a, clientIp: IP, conversation: "other", inputText: "hi" }), (e) => {
        assert.ok(e instanceof RateLimited && (e.retryAfterS ?? 0) >= 1);
        return isRefusal(429, "rate_limited", "session")(e);
      });
      await assert.rejects(sg.run({ session: b, clientIp: IP, conversation: "shared", inputText: "hi" }), (e) => {
        assert.ok(e instanceof ConcurrencyLimited && e.retryAfterS === 1);
        return isRefusal(429, "concurrency_limited", "conversation")(e);
      });
      await run.withToolStep({ tool: "web_search" }, (s) => s.commitUnits(1));
      await assert.rejects(run.toolStep({ tool: "web_search" }), (e) => {
        assert.ok(e instanceof RunBoundExceeded && e.retryAfterS === null);
        return isRefusal(400, "run_bound_exceeded", "run")(e);
      });
      await assert.rejects(run.modelStep({ model: MODEL, promptTokens: 16_001 }), (e) => {
        assert.ok(e instanceof ContextTooLarge);
        return isRefusal(400, "context_too_large", "run")(e);
      });
      await assert.rejects(run.modelStep({ model: "gpt-unpriced", promptTokens: 1 }), (e) => {
        assert.ok(e instanceof ModelNotAllowed);
        assert.deepEqual([e.status, e.code], [400, "model_not_allowed"]);
        return true;
      });
    }
    await assert.rejects(sg.run({ session: c, clientIp: IP, conversation: "c", inputText: "x".repeat(101) }), (e) => {
      assert.ok(e instanceof PayloadTooLarge);
      return isRefusal(413, "payload_too_large", "run")(e);
    });
    await server.admin("PUT", "/admin/v1/cutoff", { engaged: true, reason: "test" });
    await assert.rejects(sg.run({ session: c, clientIp: IP, conversation: "c", inputBytes: 1 }), (e) => {
      assert.ok(e instanceof CutoffEngaged && e.retryAfterS === 60);
      return isRefusal(503, "cutoff_engaged", "global")(e);
    });
  });
});

describe("a store that cannot answer", () => {
  let redis: Redis;
  let server: Server;
  before(async () => {
    redis = await Redis.start();
    server = await Server.start({ store: `kind = "redis"\nurl = "${redis.url}"\nprefix = "tsclient"\nwitness_path = "off"` });
  });
  after(async () => {
    await server?.stop();
    await redis?.stop();
  });

  it("throws StoreUnavailable, which is not a refusal", async () => {
    const sg = new Client({ baseUrl: server.url, serviceToken: SERVICE, maxRetries: 0 });
    const session = await guest(sg);
    const run = await sg.run({ session, clientIp: IP, conversation: "s", inputText: "hi" });
    await run.withToolStep({ tool: "web_search" }, (s) => s.commitUnits(1));
    await redis.stop(); // the store is gone
    await assert.rejects(run.toolStep({ tool: "web_search" }), (e) => {
      assert.ok(e instanceof StoreUnavailable && !(e instanceof SpendgateRefusal));
      assert.deepEqual([e.status, e.code, e.retryAfterS], [503, "store_unavailable", 1]);
      return true;
    });
    await assert.rejects(sg.run({ session, clientIp: IP, conversation: "s2", inputText: "hi" }), StoreUnavailable);
    await assert.rejects(run.finish(), StoreUnavailable);
  });
});
