//! The API document (OpenAPI 3.1), generated from the handlers' annotations and the types of
//! [`spendgate_wire::answers`]: served at `GET /openapi.json`, checked in at
//! `docs/openapi.json` (a test holds them equal; `SPENDGATE_BLESS=1` rewrites the file).
//!
//! It covers the decision, admin and operations API of this crate; the proxy's routes
//! (`/v1/chat/completions`, `/v1/embeddings`, `/v1/messages`) take OpenAI's and Anthropic's
//! own shapes and are documented by them.

use crate::{admin, health, history, runs, sessions, steps, usage};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use spendgate_wire::answers::{ErrorBody, ErrorDetail};
use spendgate_wire::error::ErrorCode;
use std::sync::LazyLock;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "spendgate",
        description = "A gateway that keeps an anonymous LLM chat service from spending more \
                       than its owner allows: the decision API (sessions, runs, steps, usage), \
                       the admin API and the operations routes. Errors use OpenAI's shape."
    ),
    paths(
        sessions::create_session,
        runs::create_run,
        runs::heartbeat,
        runs::finish,
        steps::create_step,
        steps::commit_step,
        steps::release_step,
        steps::unknown_step,
        usage::usage,
        admin::summary,
        admin::scopes,
        admin::reservations,
        history::history,
        admin::cutoff,
        admin::adjust,
        health::healthz,
        health::readyz,
        health::metrics,
        openapi_json,
    ),
    components(schemas(ErrorCode, ErrorBody, ErrorDetail)),
    modifiers(&Tokens, &ClosedVariants)
)]
pub struct ApiDoc;

/// The bearer tokens: the service's (`server.service_tokens`) and the admin's.
struct Tokens;

impl Modify for Tokens {
    fn modify(&self, api: &mut utoipa::openapi::OpenApi) {
        let components = api.components.get_or_insert_with(Default::default);
        for name in ["service", "admin"] {
            components.add_security_scheme(
                name,
                SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
            );
        }
    }
}

/// The request bodies that are internally tagged enums with `#[serde(deny_unknown_fields)]`.
/// utoipa marks a struct with it `additionalProperties: false`, but not the variants of an
/// enum; [`ClosedVariants`] marks theirs. (Every other request body is a struct: utoipa marks
/// those that deny unknown fields itself.)
pub const CLOSED_TAGGED_BODIES: [&str; 1] = ["StepBody"];

/// Marks every variant of the [`CLOSED_TAGGED_BODIES`] `additionalProperties: false`, as the
/// server refuses a field it does not know (400 `invalid_request`).
struct ClosedVariants;

impl Modify for ClosedVariants {
    fn modify(&self, api: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::schema::{AdditionalProperties, Schema};
        use utoipa::openapi::RefOr;
        let Some(components) = api.components.as_mut() else {
            return;
        };
        for name in CLOSED_TAGGED_BODIES {
            let Some(RefOr::T(Schema::OneOf(one_of))) = components.schemas.get_mut(name) else {
                continue;
            };
            for variant in &mut one_of.items {
                if let RefOr::T(Schema::Object(o)) = variant {
                    o.additional_properties = Some(Box::new(AdditionalProperties::FreeForm(false)));
                }
            }
        }
    }
}

/// The document, pretty-printed (what `docs/openapi.json` holds, with a final newline).
pub fn document() -> String {
    let text = ApiDoc::openapi()
        .to_pretty_json()
        .unwrap_or_else(|_| "{}".to_string());
    format!("{text}\n")
}

static DOCUMENT: LazyLock<String> = LazyLock::new(document);

/// This API's OpenAPI 3.1 document.
#[utoipa::path(get, path = "/openapi.json", tag = "operations",
    responses((status = 200, description = "the API document", body = Object)))]
pub async fn openapi_json() -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        DOCUMENT.as_str(),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    /// `docs/openapi.json` is the document the code generates, built in-process (no server).
    /// `SPENDGATE_BLESS=1` rewrites the file.
    #[test]
    fn the_checked_in_document_is_the_generated_one() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/openapi.json");
        let want = super::document();
        if std::env::var_os("SPENDGATE_BLESS").is_some_and(|v| v == "1") {
            std::fs::write(path, &want).expect("write docs/openapi.json");
        }
        let have = std::fs::read_to_string(path).unwrap_or_default();
        assert!(
            have == want,
            "docs/openapi.json differs from the generated document: \
             run `SPENDGATE_BLESS=1 cargo test -p spendgate-http openapi` and commit it"
        );
    }

    /// The step body's variants are closed, as the server refuses unknown fields, and its
    /// `max_output_tokens` is at least 1, as the server refuses 0; every request body the
    /// document names is closed.
    #[test]
    fn request_bodies_say_what_the_server_refuses() {
        let doc: serde_json::Value = serde_json::from_str(&super::document()).expect("json");
        let schemas = &doc["components"]["schemas"];
        for name in super::CLOSED_TAGGED_BODIES {
            let variants = schemas[name]["oneOf"].as_array().expect("a tagged enum");
            assert!(!variants.is_empty(), "{name}");
            for v in variants {
                assert_eq!(v["additionalProperties"], false, "{name}: {v}");
            }
        }
        let model = &schemas["StepBody"]["oneOf"][0];
        assert_eq!(model["properties"]["kind"]["enum"][0], "model", "{model}");
        assert_eq!(model["properties"]["max_output_tokens"]["minimum"], 1);
        let paths = doc["paths"].as_object().expect("paths");
        let bodies: Vec<&str> = paths
            .values()
            .filter_map(|p| p.as_object())
            .flat_map(|ops| ops.values())
            .filter_map(|op| {
                op["requestBody"]["content"]["application/json"]["schema"]["$ref"].as_str()
            })
            .collect();
        assert!(bodies.len() >= 6, "{bodies:?}");
        for r in bodies {
            let name = r.trim_start_matches("#/components/schemas/");
            let s = &schemas[name];
            let closed = s["additionalProperties"] == false
                || s["oneOf"]
                    .as_array()
                    .is_some_and(|vs| vs.iter().all(|v| v["additionalProperties"] == false));
            assert!(closed, "{name} is not closed: {s}");
        }
    }

    /// The server refuses what the document says it refuses: an unknown field in either
    /// variant of the step body, and a `max_output_tokens` of 0 (in `step_kind`).
    #[test]
    fn the_step_body_refuses_unknown_fields() {
        use crate::steps::StepBody;
        for body in [
            r#"{"kind": "model", "model": "m", "prompt_tokens": 1, "extra": 1}"#,
            r#"{"kind": "tool", "tool": "t", "extra": 1}"#,
        ] {
            assert!(serde_json::from_str::<StepBody>(body).is_err(), "{body}");
        }
        assert!(serde_json::from_str::<StepBody>(r#"{"kind": "tool", "tool": "t"}"#).is_ok());
    }

    /// Every error code is in the document's enum of codes.
    #[test]
    fn the_document_lists_every_error_code() {
        let doc: serde_json::Value = serde_json::from_str(&super::document()).expect("json");
        assert_eq!(doc["openapi"].as_str().map(|v| &v[..3]), Some("3.1"));
        let codes = &doc["components"]["schemas"]["ErrorCode"]["enum"];
        let want: Vec<&str> = spendgate_wire::error::ErrorCode::ALL
            .iter()
            .map(|c| c.as_str())
            .collect();
        assert_eq!(codes, &serde_json::json!(want));
    }
}
