// The client: `Client`, `Run`, `Step`. fetch only, no dependencies, no Node-only API.

import "./polyfill.js";
import { NotFound, RunClosed, SpendgateConnectionError, SpendgateError, errorFromAnswer } from "./errors.js";
import type {
  CommitBody,
  CreateRunBody,
  FinishAnswer,
  HeartbeatAnswer,
  ModelStepBody,
  ResolvedAnswer,
  RunAnswer,
  RunBounds,
  SessionAnswer,
  StepAnswer,
  ToolStepBody,
  UsageAnswer,
  UsageBody,
} from "./types.js";

/** Milliseconds each HTTP call may take before it counts as failed. */
export const DEFAULT_TIMEOUT_MS = 10_000;
/** Retries of a call that got no answer (or 500/504, which may have applied); each reuses the
 * call's `Idempotency-Key`, so nothing is held twice. */
export const DEFAULT_MAX_RETRIES = 2;
/** Upper bound of `maxRetries`. */
export const MAX_RETRIES_MAX = 10;
/** First wait between retries; it doubles each time. */
export const RETRY_BACKOFF_MS = 250;
/** Longest wait between retries, whatever `Retry-After` says. */
export const RETRY_WAIT_MAX_MS = 5_000;
/** A held step's run is renewed at this fraction of the lease left after each heartbeat. */
export const HEARTBEAT_FRACTION = 1 / 3;
/** Bounds of the interval between heartbeats. */
export const HEARTBEAT_MIN_MS = 250;
export const HEARTBEAT_MAX_MS = 60_000;
/** `Idempotency-Key` bound of the server. */
export const IDEMPOTENCY_KEY_MAX = 100;

/** Retry on no answer and 500/504: run and step creation. */
type Policy = "create" | "resolve" | "once";
/** Answers to commit, release or unknown after which the step is no longer held. */
const CLOSED_CODES = new Set(["reservation_closed", "not_found"]);

export interface ClientOptions {
  /** The gateway, e.g. `http://127.0.0.1:8080`. */
  baseUrl: string;
  /** A service token (`server.service_tokens`). */
  serviceToken: string;
  timeoutMs?: number;
  maxRetries?: number;
  /** A fixed interval between heartbeats; by default a third of the lease the server reports. */
  heartbeatIntervalMs?: number;
  /** The fetch to use (default: the global one). */
  fetch?: typeof fetch;
  /** Where warnings go (a step left unresolved); default `console.warn`. */
  onWarning?: (message: string) => void;
}

export interface RunOptions {
  session: string;
  clientIp: string;
  conversation: string;
  /** The user's message (its bytes are counted), or `inputBytes`: exactly one. */
  inputText?: string;
  inputBytes?: number;
  idempotencyKey?: string;
}

export interface ModelStepOptions {
  model: string;
  /** The prompt's tokens, or `promptText` (counted by the server): exactly one. */
  promptTokens?: number;
  promptText?: string;
  maxOutputTokens?: number;
  retry?: boolean;
  idempotencyKey?: string;
}

export interface ToolStepOptions {
  tool: string;
  units?: number;
  idempotencyKey?: string;
}

export interface UsageOptions {
  session: string;
  clientIp?: string;
  conversation?: string;
}

/** A usage to commit: the wire's, OpenAI's (Chat Completions or Responses), or the AI SDK's. */
export type UsageLike =
  | UsageBody
  | {
      prompt_tokens: number;
      completion_tokens: number;
      prompt_tokens_details?: { cached_tokens?: number | null } | null;
    }
  | {
      input_tokens: number;
      output_tokens: number;
      input_tokens_details?: { cached_tokens?: number | null } | null;
    }
  | { promptTokens: number; completionTokens: number; cachedTokens?: number }
  | { inputTokens: number; outputTokens: number; cachedInputTokens?: number };

interface Answer<T> {
  body: T;
  headers: Headers;
}

function sleep(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

function count(name: string, v: unknown): number {
  if (typeof v !== "number" || !Number.isSafeInteger(v) || v < 0) {
    throw new TypeError(`${name} must be a non-negative integer, got ${String(v)}`);
  }
  return v;
}

function newKey(key: string | undefined): string {
  if (key === undefined) return `sg-${globalThis.crypto.randomUUID()}`;
  if (key.length < 1 || key.length > IDEMPOTENCY_KEY_MAX || !/^[\x21-\x7e]+$/.test(key)) {
    throw new TypeError("idempotencyKey must be 1 to 100 visible ASCII characters");
  }
  return key;
}

function shouldRetry(policy: Policy, err: SpendgateError | null): boolean {
  if (policy === "once") return false;
  if (err === null) return true;
  if ((err.status === 500 || err.status === 504) && ["internal_error", "timeout", ""].includes(err.code)) {
    return true;
  }
  return policy === "resolve" && err.code === "store_unavailable";
}

function retryWait(attempt: number, err: SpendgateError | null): number {
  let wait = RETRY_BACKOFF_MS * 2 ** attempt;
  if (err !== null && err.retryAfterS !== null) wait = Math.max(wait, err.retryAfterS * 1000);
  return Math.min(wait, RETRY_WAIT_MAX_MS);
}

/** The wait before the next heartbeat: a fraction of the lease granted, by the server's clock. */
export function heartbeatInterval(leaseUntil: string, dateHeader: string | null): number {
  const until = Date.parse(leaseUntil);
  const serverNow = dateHeader === null ? NaN : Date.parse(dateHeader);
  const now = Number.isNaN(serverNow) ? Date.now() : serverNow;
  if (Number.isNaN(until)) return HEARTBEAT_MIN_MS;
  const left = until - now;
  return Math.min(HEARTBEAT_MAX_MS, Math.max(HEARTBEAT_MIN_MS, left * HEARTBEAT_FRACTION));
}

function get(obj: unknown, key: string): unknown {
  return typeof obj === "object" && obj !== null ? (obj as Record<string, unknown>)[key] : undefined;
}

/**
 * The `usage` of a commit. Takes the wire's and OpenAI's Chat Completions shape
 * (`prompt_tokens`, `completion_tokens`, `prompt_tokens_details.cached_tokens`), OpenAI's
 * Responses shape (`input_tokens`, `output_tokens`, `input_tokens_details.cached_tokens`) and
 * the AI SDK's (`promptTokens`/`completionTokens`, or `inputTokens`/`outputTokens`/
 * `cachedInputTokens`). Anthropic's usage counts cached input apart and is refused.
 */
export function usageBody(usage: UsageLike): UsageBody {
  if (get(usage, "cache_read_input_tokens") !== undefined || get(usage, "cache_creation_input_tokens") !== undefined) {
    throw new TypeError(
      "an Anthropic usage counts cached input apart: commit {prompt_tokens: input + cache_read + " +
        "cache_creation, cached_tokens: cache_read, completion_tokens: output}",
    );
  }
  const pairs: Array<[string, string, unknown]> = [
    ["prompt_tokens", "completion_tokens", get(get(usage, "prompt_tokens_details"), "cached_tokens") ?? get(usage, "cached_tokens")],
    ["input_tokens", "output_tokens", get(get(usage, "input_tokens_details"), "cached_tokens")],
    ["promptTokens", "completionTokens", get(usage, "cachedTokens")],
    ["inputTokens", "outputTokens", get(usage, "cachedInputTokens")],
  ];
  for (const [p, c, cached] of pairs) {
    if (get(usage, p) === undefined && get(usage, c) === undefined) continue;
    const body: UsageBody = {
      prompt_tokens: count(p, get(usage, p)),
      completion_tokens: count(c, get(usage, c)),
    };
    if (cached !== undefined && cached !== null) body.cached_tokens = count("cached_tokens", cached);
    return body;
  }
  throw new TypeError("a usage needs prompt_tokens and completion_tokens (or input/output tokens)");
}

/** A client of spendgate's decision API, with the service token. */
export class Client {
  readonly #base: string;
  readonly #token: string;
  readonly #timeoutMs: number;
  readonly #maxRetries: number;
  readonly #fetch: typeof fetch;
  /** @internal */ readonly heartbeatFixedMs: number | undefined;
  /** @internal */ heartbeatLearnedMs: number | undefined;
  /** @internal */ readonly warn: (message: string) => void;

  constructor(opts: ClientOptions) {
    if (!opts.serviceToken) throw new TypeError("serviceToken is required");
    const retries = opts.maxRetries ?? DEFAULT_MAX_RETRIES;
    if (!Number.isInteger(retries) || retries < 0 || retries > MAX_RETRIES_MAX) {
      throw new TypeError(`maxRetries must be an integer from 0 to ${MAX_RETRIES_MAX}`);
    }
    this.#base = opts.baseUrl.replace(/\/+$/, "");
    this.#token = opts.serviceToken;
    this.#timeoutMs = opts.timeoutMs ?? DEFAULT_TIMEOUT_MS;
    this.#maxRetries = retries;
    this.#fetch = opts.fetch ?? globalThis.fetch.bind(globalThis);
    this.heartbeatFixedMs = opts.heartbeatIntervalMs;
    this.warn = opts.onWarning ?? ((m) => console.warn(m));
  }

  /** Creates a guest session (`POST /v1/sessions`) for a guest at `clientIp`. */
  async session(opts: { clientIp?: string } = {}): Promise<SessionAnswer> {
    const body = opts.clientIp === undefined ? {} : { client_ip: opts.clientIp };
    return (await this.call<SessionAnswer>("POST", "/v1/sessions", body, undefined, "once")).body;
  }

  /** Admits a run (`POST /v1/runs`); a refusal throws a `SpendgateRefusal`. Use it with
   * `await using`, or call `finish()` yourself; or use `withRun`. */
  async run(opts: RunOptions): Promise<Run> {
    if ((opts.inputText === undefined) === (opts.inputBytes === undefined)) {
      throw new TypeError("pass exactly one of inputText and inputBytes");
    }
    const body: CreateRunBody = { session: opts.session, client_ip: opts.clientIp, conversation: opts.conversation };
    if (opts.inputText !== undefined) body.input_text = opts.inputText;
    else body.input_bytes = count("inputBytes", opts.inputBytes);
    const ans = await this.call<RunAnswer>("POST", "/v1/runs", body, newKey(opts.idempotencyKey), "create");
    return new Run(this, ans.body);
  }

  /** Runs `fn` in a run: `finish` after it, whatever happens. */
  async withRun<T>(opts: RunOptions, fn: (run: Run) => Promise<T>): Promise<T> {
    const run = await this.run(opts);
    let result: T;
    try {
      result = await fn(run);
    } catch (e) {
      await run.finish().catch(() => undefined); // else its lease expires: charged in full
      throw e;
    }
    await run.finish();
    return result;
  }

  /** Every budget that applies to a guest (`GET /v1/usage`), global included. */
  async usage(opts: UsageOptions): Promise<UsageAnswer> {
    const q = new URLSearchParams({ session: opts.session });
    if (opts.clientIp !== undefined) q.set("client_ip", opts.clientIp);
    if (opts.conversation !== undefined) q.set("conversation", opts.conversation);
    return (await this.call<UsageAnswer>("GET", `/v1/usage?${q}`, undefined, undefined, "once")).body;
  }

  /** @internal One call, with its retries. */
  async call<T>(method: string, path: string, body: unknown, key: string | undefined, policy: Policy): Promise<Answer<T>> {
    const headers: Record<string, string> = { authorization: `Bearer ${this.#token}` };
    if (body !== undefined) headers["content-type"] = "application/json";
    if (key !== undefined) headers["idempotency-key"] = key;
    const init = { method, headers, body: body === undefined ? null : JSON.stringify(body) };
    for (let attempt = 0; ; attempt++) {
      let err: SpendgateError | null = null;
      let last: SpendgateError;
      const res = await this.#send(this.#base + path, init);
      if (res instanceof Error) {
        last = new SpendgateConnectionError(`${method} ${path}: ${res.message}`);
      } else {
        const text = res.text;
        let parsed: unknown = undefined;
        try {
          parsed = text ? JSON.parse(text) : undefined;
        } catch {
          parsed = undefined;
        }
        if (res.status < 400) {
          if (typeof parsed !== "object" || parsed === null) {
            throw new SpendgateError(`spendgate answered ${res.status} without a JSON object`, { status: res.status });
          }
          return { body: parsed as T, headers: res.headers };
        }
        err = errorFromAnswer(res.status, parsed, res.headers.get("retry-after"));
        last = err;
      }
      if (attempt >= this.#maxRetries || !shouldRetry(policy, err)) throw last;
      await sleep(retryWait(attempt, err));
    }
  }

  async #send(
    url: string,
    init: { method: string; headers: Record<string, string>; body: string | null },
  ): Promise<{ status: number; headers: Headers; text: string } | Error> {
    const abort = new AbortController();
    const timer = setTimeout(() => abort.abort(), this.#timeoutMs);
    try {
      const r = await this.#fetch(url, { ...init, signal: abort.signal });
      return { status: r.status, headers: r.headers, text: await r.text() };
    } catch (e) {
      return e instanceof Error ? e : new Error(String(e));
    } finally {
      clearTimeout(timer);
    }
  }
}

/** Renews a run's lease while any of its steps is held. */
class Heartbeat {
  #timer: ReturnType<typeof setTimeout> | undefined;
  #stopped = false;
  #inFlight: Promise<void> = Promise.resolve();

  constructor(private readonly run: Run) {
    const c = run.client;
    this.#schedule(c.heartbeatFixedMs ?? c.heartbeatLearnedMs ?? 0);
  }

  #schedule(ms: number): void {
    if (this.#stopped) return;
    this.#timer = setTimeout(() => {
      this.#inFlight = this.#beat(ms);
    }, ms);
    // Node: a forgotten run does not keep the process alive.
    (this.#timer as { unref?: () => void }).unref?.();
  }

  async #beat(previous: number): Promise<void> {
    const c = this.run.client;
    try {
      const { body, headers } = await this.run.beat();
      const learned = heartbeatInterval(body.lease_until, headers.get("date"));
      if (c.heartbeatFixedMs === undefined) c.heartbeatLearnedMs = learned;
      this.#schedule(c.heartbeatFixedMs === undefined ? learned : Math.min(c.heartbeatFixedMs, learned));
    } catch (e) {
      if (e instanceof RunClosed || e instanceof NotFound) return;
      this.#schedule(previous > 0 ? previous : HEARTBEAT_MIN_MS);
    }
  }

  async stop(): Promise<void> {
    this.#stopped = true;
    clearTimeout(this.#timer);
    await this.#inFlight;
  }
}

/** An admitted run. `await using run = await client.run({...})` finishes it on leaving. */
export class Run implements AsyncDisposable {
  readonly answer: RunAnswer;
  /** How it ended, once `finish` answered. */
  finished: FinishAnswer | undefined;
  #held = 0;
  #heartbeat: Heartbeat | undefined;

  /** @internal */
  constructor(
    /** @internal */ readonly client: Client,
    answer: RunAnswer,
  ) {
    this.answer = answer;
  }

  get runId(): string {
    return this.answer.run_id;
  }
  get deadline(): string {
    return this.answer.deadline;
  }
  get bounds(): RunBounds {
    return this.answer.bounds;
  }
  get reservedMicros(): number {
    return this.answer.reserved_micros;
  }

  /** Reserves a model step; a refusal throws a `SpendgateRefusal`. */
  async modelStep(opts: ModelStepOptions): Promise<Step> {
    if ((opts.promptTokens === undefined) === (opts.promptText === undefined)) {
      throw new TypeError("pass exactly one of promptTokens and promptText");
    }
    const body: ModelStepBody = { kind: "model", model: opts.model };
    if (opts.promptTokens !== undefined) body.prompt_tokens = count("promptTokens", opts.promptTokens);
    else body.prompt_text = opts.promptText ?? null;
    if (opts.maxOutputTokens !== undefined) body.max_output_tokens = count("maxOutputTokens", opts.maxOutputTokens);
    if (opts.retry) body.retry = true;
    return this.#step(body, opts.idempotencyKey);
  }

  /** Reserves a paid tool step; a refusal throws a `SpendgateRefusal`. */
  async toolStep(opts: ToolStepOptions): Promise<Step> {
    const body: ToolStepBody = { kind: "tool", tool: opts.tool };
    if (opts.units !== undefined) body.units = count("units", opts.units);
    return this.#step(body, opts.idempotencyKey);
  }

  /** Runs `fn` with a model step: `unknown` if it throws or leaves the step unresolved. */
  async withModelStep<T>(opts: ModelStepOptions, fn: (step: Step) => Promise<T>): Promise<T> {
    return withStep(await this.modelStep(opts), fn);
  }

  /** Runs `fn` with a tool step: `unknown` if it throws or leaves the step unresolved. */
  async withToolStep<T>(opts: ToolStepOptions, fn: (step: Step) => Promise<T>): Promise<T> {
    return withStep(await this.toolStep(opts), fn);
  }

  async #step(body: ModelStepBody | ToolStepBody, key: string | undefined): Promise<Step> {
    const path = `/v1/runs/${encodeURIComponent(this.runId)}/steps`;
    const ans = await this.client.call<StepAnswer>("POST", path, body, newKey(key), "create");
    this.#held += 1;
    this.#heartbeat ??= new Heartbeat(this);
    return new Step(this, ans.body);
  }

  /** @internal */
  async unhold(): Promise<void> {
    this.#held -= 1;
    if (this.#held === 0) await this.#stopHeartbeat();
  }

  async #stopHeartbeat(): Promise<void> {
    const hb = this.#heartbeat;
    this.#heartbeat = undefined;
    await hb?.stop();
  }

  /** Renews the run's lease now (the background heartbeat does it while a step is held). */
  async heartbeat(): Promise<HeartbeatAnswer> {
    return (await this.beat()).body;
  }

  /** @internal */
  beat(): Promise<Answer<HeartbeatAnswer>> {
    const path = `/v1/runs/${encodeURIComponent(this.runId)}/heartbeat`;
    return this.client.call<HeartbeatAnswer>("POST", path, undefined, undefined, "once");
  }

  /** Ends the run: steps still held become `unknown` (charged in full). */
  async finish(): Promise<FinishAnswer> {
    await this.#stopHeartbeat();
    const path = `/v1/runs/${encodeURIComponent(this.runId)}/finish`;
    this.finished = (await this.client.call<FinishAnswer>("POST", path, undefined, undefined, "resolve")).body;
    return this.finished;
  }

  async [Symbol.asyncDispose](): Promise<void> {
    if (this.finished === undefined) await this.finish();
  }
}

async function withStep<T>(step: Step, fn: (step: Step) => Promise<T>): Promise<T> {
  let result: T;
  try {
    result = await fn(step);
  } catch (e) {
    if (step.resolution === undefined) await step.unknown().catch(() => undefined);
    await step.settle();
    throw e;
  }
  await step[Symbol.asyncDispose]();
  return result;
}

/**
 * A reserved step. Leaving an `await using` block (or `withModelStep`/`withToolStep`) with
 * neither commit nor release marks it `unknown`, charged in full, whether the block threw or
 * not: spendgate cannot know whether the paid work happened. Without a throw it also warns.
 */
export class Step implements AsyncDisposable {
  readonly answer: StepAnswer;
  resolution: ResolvedAnswer | undefined;
  #holding = true;

  /** @internal */
  constructor(
    private readonly run: Run,
    answer: StepAnswer,
  ) {
    this.answer = answer;
  }

  get stepId(): string {
    return this.answer.step_id;
  }
  get reservedMicros(): number {
    return this.answer.reserved_micros;
  }
  /** The output bound to give the model (null for a tool). */
  get maxOutputTokens(): number | null {
    return this.answer.max_output_tokens ?? null;
  }
  get outputShrunk(): boolean {
    return this.answer.output_shrunk;
  }

  /** Commits a model step's usage (see `UsageLike` for the shapes taken). */
  commit(usage: UsageLike): Promise<ResolvedAnswer> {
    return this.#resolve("commit", { usage: usageBody(usage) });
  }
  /** Commits a tool step by the units it used. */
  commitUnits(units: number): Promise<ResolvedAnswer> {
    return this.#resolve("commit", { units: count("units", units) });
  }
  /** Commits a tool step by its result's size (flagged when over the run's bound). */
  commitResultBytes(resultBytes: number): Promise<ResolvedAnswer> {
    return this.#resolve("commit", { result_bytes: count("resultBytes", resultBytes) });
  }
  /** No paid work started: nothing is charged. */
  release(): Promise<ResolvedAnswer> {
    return this.#resolve("release", undefined);
  }
  /** The outcome is not known: the full reservation is charged. */
  unknown(): Promise<ResolvedAnswer> {
    return this.#resolve("unknown", undefined);
  }

  async #resolve(what: string, body: CommitBody | undefined): Promise<ResolvedAnswer> {
    const path = `/v1/steps/${encodeURIComponent(this.stepId)}/${what}`;
    try {
      this.resolution = (await this.run.client.call<ResolvedAnswer>("POST", path, body, undefined, "resolve")).body;
    } catch (e) {
      if (e instanceof SpendgateError && CLOSED_CODES.has(e.code)) await this.settle();
      throw e;
    }
    await this.settle();
    return this.resolution;
  }

  /** @internal No longer held by this client: the run's heartbeat may stop. */
  async settle(): Promise<void> {
    if (this.#holding) {
      this.#holding = false;
      await this.run.unhold();
    }
  }

  async [Symbol.asyncDispose](): Promise<void> {
    try {
      if (this.resolution === undefined) {
        this.run.client.warn(
          `spendgate: step ${this.stepId} ended with neither commit nor release: marked unknown (charged in full)`,
        );
        await this.unknown();
      }
    } finally {
      await this.settle();
    }
  }
}
