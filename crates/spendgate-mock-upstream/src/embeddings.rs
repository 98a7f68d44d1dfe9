//! `POST /v1/embeddings`: OpenAI's Embeddings shape (see the crate docs' Embeddings section).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::{aborted_response, error_response, Fault, MockUpstream, Plan, MAX_WAIT};

/// Dimensions of every embedding the mock answers.
pub const EMBEDDING_DIMENSIONS: usize = 8;

/// The inputs of an embeddings request: strings, or token arrays.
fn inputs(body: &Value) -> Result<Vec<&Value>, String> {
    let input = body
        .get("input")
        .ok_or_else(|| "input must be a string or an array".to_owned())?;
    let tokens = |v: &Value| v.as_array().is_some_and(|a| a.iter().all(Value::is_u64));
    match input {
        Value::String(_) => Ok(vec![input]),
        Value::Array(a) if !a.is_empty() && tokens(input) => Ok(vec![input]),
        Value::Array(a) if !a.is_empty() && a.iter().all(|v| v.is_string() || tokens(v)) => {
            Ok(a.iter().collect())
        }
        _ => Err("input must be a string, an array of strings or token arrays".to_owned()),
    }
}

/// How many inputs an embeddings request holds (0 for any other request).
pub(crate) fn count(body: &Value) -> usize {
    inputs(body).map_or(0, |i| i.len())
}

/// The prompt tokens of an embeddings request: each string's `ceil(bytes / 4)`, each token
/// array's length.
pub(crate) fn prompt_tokens(body: &Value) -> Result<u64, String> {
    Ok(inputs(body)?
        .iter()
        .map(|v| match v {
            Value::String(s) => (s.len() as u64).div_ceil(4),
            other => other.as_array().map_or(0, |a| a.len() as u64),
        })
        .sum())
}

/// The answer to a planned embeddings request, after its latency: the faults that apply to a
/// whole answer (`no_usage`, `usage_over`: 10 prompt tokens more, reported and counted), else
/// one embedding per input.
pub(crate) async fn answer(mock: MockUpstream, mut plan: Plan) -> Response {
    match plan.fault {
        Fault::Http429 => error_response(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            Some("rate_limit_exceeded"),
            "mock upstream: rate limited (fault http_429)",
        ),
        Fault::Http500 => error_response(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            None,
            "mock upstream: internal error (fault http_500)",
        ),
        Fault::Http504 => {
            mock.count_prompt(&plan);
            error_response(
                StatusCode::GATEWAY_TIMEOUT,
                "server_error",
                None,
                "mock upstream: gateway timeout after the work was done (fault http_504)",
            )
        }
        Fault::Hang => {
            mock.count_prompt(&plan);
            tokio::time::sleep(MAX_WAIT).await;
            aborted_response()
        }
        Fault::DropMidStream => {
            mock.count_prompt(&plan);
            aborted_response()
        }
        _ => {
            if plan.fault == Fault::UsageOver {
                plan.prompt_tokens = plan.prompt_tokens.saturating_add(10);
            }
            let n = plan.inputs.max(1);
            let data: Vec<Value> = (0..n)
                .map(|i| {
                    let v: Vec<f64> = (0..EMBEDDING_DIMENSIONS)
                        .map(|d| ((i + d) % 7) as f64 / 7.0)
                        .collect();
                    json!({"object": "embedding", "index": i, "embedding": v})
                })
                .collect();
            let mut answer = json!({"object": "list", "data": data, "model": plan.model});
            if plan.fault != Fault::NoUsage {
                answer["usage"] = json!({"prompt_tokens": plan.prompt_tokens,
                    "total_tokens": plan.prompt_tokens});
            }
            mock.count_prompt(&plan);
            mock.count_completed(&plan);
            (StatusCode::OK, Json(answer)).into_response()
        }
    }
}
