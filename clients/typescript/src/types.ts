// The wire shapes of the decision API, written by hand from docs/openapi.json (the schema of
// each is named in its comment; test/openapi.test.ts holds the field names of these types
// equal to the document's). Field names are the wire's (snake_case). Money is integer micros,
// times are RFC 3339 strings.

/** `RunBoundsAnswer`: a run's bounds, as admitted. */
export interface RunBounds {
  max_input_bytes: number;
  max_context_tokens: number;
  max_output_tokens: number;
  max_tool_result_bytes: number;
  max_model_rounds: number;
  max_tool_calls: number;
  max_retries: number;
  max_seconds: number;
  max_cost_micros: number;
}

/** `RunAnswer`: `POST /v1/runs`, an admitted run. */
export interface RunAnswer {
  run_id: string;
  deadline: string;
  bounds: RunBounds;
  reserved_micros: number;
  ledger_seq: number;
}

/** `StepAnswer`: `POST /v1/runs/{run_id}/steps`, an admitted step. */
export interface StepAnswer {
  step_id: string;
  reserved_micros: number;
  /** The output bound to give the model (model steps); null for a tool. */
  max_output_tokens?: number | null;
  output_shrunk: boolean;
  ledger_seq: number;
}

/** `ResolvedAnswer`: commit, release and unknown. */
export interface ResolvedAnswer {
  state: string;
  charged_micros: number;
  reserved_micros: number;
  overrun: boolean;
  repeated: boolean;
  ledger_seq: number;
  result_too_large?: boolean | null;
  message?: string | null;
}

/** `HeartbeatAnswer`: the run's lease, extended. */
export interface HeartbeatAnswer {
  lease_until: string;
  deadline: string;
  ledger_seq: number;
}

/** `FinishAnswer`: the run, closed (`finished` or `expired`). */
export interface FinishAnswer {
  state: string;
  charged_micros: number;
  /** What the run's budgets were charged (`whole_run`: its hold as committed or expired). */
  budgets_charged_micros: number;
  steps: number;
  repeated: boolean;
  ledger_seq: number;
}

/** `UsageScope`: one budget that applies, in its current window. */
export interface UsageScope {
  kind: string;
  id?: string | null;
  window: string;
  window_id: string;
  limit_micros: number;
  used_micros: number;
  reserved_micros: number;
  remaining_micros: number;
  overrun: boolean;
  resets_at?: string | null;
}

/** `UsageAnswer`: `GET /v1/usage`, every budget that applies, global included. */
export interface UsageAnswer {
  scopes: UsageScope[];
}

/** `SessionAnswer`: `POST /v1/sessions`. */
export interface SessionAnswer {
  session: string;
  expires_at: string;
  ledger_seq: number;
}

/** `ErrorDetail`: the inside of an error answer. */
export interface ErrorDetail {
  type: string;
  code: ErrorCode;
  message: string;
  param?: string | null;
  scope?: string | null;
  retry_after_s?: number | null;
  challenge?: Record<string, unknown> | null;
}

/** `ErrorBody`: every refusal, in OpenAI's error shape. */
export interface ErrorBody {
  error: ErrorDetail;
  ledger_seq?: number | null;
  challenge?: Record<string, unknown> | null;
}

/** `ErrorCode`: every code the server answers with. */
export type ErrorCode =
  | "rate_limited"
  | "concurrency_limited"
  | "budget_exhausted"
  | "budget_held"
  | "run_bound_exceeded"
  | "payload_too_large"
  | "context_too_large"
  | "model_not_allowed"
  | "cutoff_engaged"
  | "store_unavailable"
  | "invalid_request"
  | "idempotency_conflict"
  | "unauthorized"
  | "challenge_required"
  | "reservation_closed"
  | "run_closed"
  | "not_found"
  | "request_timeout"
  | "timeout"
  | "internal_error"
  | "run_deadline_exceeded"
  | "upstream_error"
  | "upstream_timeout"
  | "upstream_unreachable";

/** `CreateRunBody`. */
export interface CreateRunBody {
  session: string;
  client_ip: string;
  conversation: string;
  input_text?: string | null;
  input_bytes?: number | null;
}

/** `StepBody`, a model step. */
export interface ModelStepBody {
  kind: "model";
  model: string;
  prompt_tokens?: number | null;
  prompt_text?: string | null;
  max_output_tokens?: number | null;
  retry?: boolean;
}

/** `StepBody`, a tool step. */
export interface ToolStepBody {
  kind: "tool";
  tool: string;
  units?: number | null;
}

/** `UsageBody`: a model step's usage, as committed. */
export interface UsageBody {
  prompt_tokens: number;
  completion_tokens: number;
  cached_tokens?: number;
}

/** `CommitBody`: exactly one of its fields. */
export interface CommitBody {
  usage?: UsageBody | null;
  units?: number | null;
  result_bytes?: number | null;
}

/** `CreateSessionBody`. */
export interface CreateSessionBody {
  client_ip?: string | null;
  challenge?: Record<string, unknown> | null;
  solution?: string | null;
}
