// The hand-written wire types of src/types.ts against docs/openapi.json: the same fields, and
// the same ones required. Each `Shape<T>` below must list every field of T, each marked as T
// marks it (the compiler checks that), and the test compares it with the document's schema.

import { readFileSync } from "node:fs";
import { join } from "node:path";
import assert from "node:assert/strict";
import { it } from "node:test";

import type * as T from "../src/types.js";
import { ERRORS_BY_CODE } from "../src/index.js";
import { REPO } from "./server.js";

type Shape<X> = { [K in keyof Required<X>]: {} extends Pick<X, K> ? "optional" : "required" };

const shapes: Record<string, Shape<unknown> | Record<string, "optional" | "required">> = {
  RunBoundsAnswer: {
    max_input_bytes: "required",
    max_context_tokens: "required",
    max_output_tokens: "required",
    max_tool_result_bytes: "required",
    max_model_rounds: "required",
    max_tool_calls: "required",
    max_retries: "required",
    max_seconds: "required",
    max_cost_micros: "required",
  } satisfies Shape<T.RunBounds>,
  RunAnswer: {
    run_id: "required",
    deadline: "required",
    bounds: "required",
    reserved_micros: "required",
    ledger_seq: "required",
  } satisfies Shape<T.RunAnswer>,
  StepAnswer: {
    step_id: "required",
    reserved_micros: "required",
    max_output_tokens: "optional",
    output_shrunk: "required",
    ledger_seq: "required",
  } satisfies Shape<T.StepAnswer>,
  ResolvedAnswer: {
    state: "required",
    charged_micros: "required",
    reserved_micros: "required",
    overrun: "required",
    repeated: "required",
    ledger_seq: "required",
    result_too_large: "optional",
    message: "optional",
  } satisfies Shape<T.ResolvedAnswer>,
  HeartbeatAnswer: {
    lease_until: "required",
    deadline: "required",
    ledger_seq: "required",
  } satisfies Shape<T.HeartbeatAnswer>,
  FinishAnswer: {
    state: "required",
    charged_micros: "required",
    budgets_charged_micros: "required",
    steps: "required",
    repeated: "required",
    ledger_seq: "required",
  } satisfies Shape<T.FinishAnswer>,
  UsageScope: {
    kind: "required",
    id: "optional",
    window: "required",
    window_id: "required",
    limit_micros: "required",
    used_micros: "required",
    reserved_micros: "required",
    remaining_micros: "required",
    overrun: "required",
    resets_at: "optional",
  } satisfies Shape<T.UsageScope>,
  UsageAnswer: { scopes: "required" } satisfies Shape<T.UsageAnswer>,
  SessionAnswer: { session: "required", expires_at: "required", ledger_seq: "required" } satisfies Shape<T.SessionAnswer>,
  ErrorDetail: {
    type: "required",
    code: "required",
    message: "required",
    param: "optional",
    scope: "optional",
    retry_after_s: "optional",
    challenge: "optional",
  } satisfies Shape<T.ErrorDetail>,
  ErrorBody: { error: "required", ledger_seq: "optional", challenge: "optional" } satisfies Shape<T.ErrorBody>,
  CreateRunBody: {
    session: "required",
    client_ip: "required",
    conversation: "required",
    input_text: "optional",
    input_bytes: "optional",
  } satisfies Shape<T.CreateRunBody>,
  UsageBody: { prompt_tokens: "required", completion_tokens: "required", cached_tokens: "optional" } satisfies Shape<T.UsageBody>,
  CommitBody: { usage: "optional", units: "optional", result_bytes: "optional" } satisfies Shape<T.CommitBody>,
  CreateSessionBody: { client_ip: "optional", challenge: "optional", solution: "optional" } satisfies Shape<T.CreateSessionBody>,
};

const stepBodies = {
  model: {
    kind: "required",
    model: "required",
    prompt_tokens: "optional",
    prompt_text: "optional",
    max_output_tokens: "optional",
    retry: "optional",
  } satisfies Shape<T.ModelStepBody>,
  tool: { kind: "required", tool: "required", units: "optional" } satisfies Shape<T.ToolStepBody>,
};

interface Schema {
  properties?: Record<string, unknown>;
  required?: string[];
  oneOf?: Schema[];
  enum?: string[];
}

const doc = JSON.parse(readFileSync(join(REPO, "docs/openapi.json"), "utf8")) as {
  components: { schemas: Record<string, Schema> };
};
const schemas = doc.components.schemas;

function asShape(s: Schema): Record<string, string> {
  const req = new Set(s.required ?? []);
  return Object.fromEntries(Object.keys(s.properties ?? {}).map((k) => [k, req.has(k) ? "required" : "optional"]));
}

const sorted = (o: Record<string, string>) => Object.fromEntries(Object.entries(o).sort());

it("every wire type has the document's fields, required as the document says", () => {
  for (const [name, shape] of Object.entries(shapes)) {
    const s = schemas[name];
    assert.ok(s, `docs/openapi.json has no schema ${name}`);
    assert.deepEqual(sorted(shape as Record<string, string>), sorted(asShape(s)), name);
  }
});

it("the step bodies are the document's StepBody", () => {
  const variants = schemas.StepBody?.oneOf ?? [];
  assert.equal(variants.length, 2);
  for (const v of variants) {
    const kind = ((v.properties?.kind as Schema | undefined)?.enum ?? [])[0] as "model" | "tool";
    assert.deepEqual(sorted(stepBodies[kind]), sorted(asShape(v)), `StepBody ${kind}`);
  }
});

it("every error code of the document is a code of the type, and each refusal has its class", () => {
  const codes: T.ErrorCode[] = [
    "rate_limited", "concurrency_limited", "budget_exhausted", "budget_held", "run_bound_exceeded",
    "payload_too_large", "context_too_large", "model_not_allowed", "cutoff_engaged", "store_unavailable",
    "invalid_request", "idempotency_conflict", "unauthorized", "challenge_required", "reservation_closed",
    "run_closed", "not_found", "request_timeout", "timeout", "internal_error", "run_deadline_exceeded",
    "upstream_error", "upstream_timeout", "upstream_unreachable",
  ];
  assert.deepEqual([...codes].sort(), [...(schemas.ErrorCode?.enum ?? [])].sort());
  for (const code of ["rate_limited", "concurrency_limited", "budget_exhausted", "budget_held",
    "run_bound_exceeded", "payload_too_large", "context_too_large", "model_not_allowed", "cutoff_engaged",
    "store_unavailable"]) {
    assert.ok(ERRORS_BY_CODE[code], code);
  }
});
