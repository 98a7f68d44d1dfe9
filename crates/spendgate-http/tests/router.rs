//! Validation and error shapes at the router, in-process (`tower::ServiceExt::oneshot`, no
//! socket, no process): what a bad request is answered, in OpenAI's error shape.

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::http::{header, Request, StatusCode};
use serde_json::Value;
use spendgate_wire::error::ErrorCode;
use std::net::SocketAddr;
use std::sync::Arc;
use tower::ServiceExt;

const SERVICE: &str = "router-service-token-0123456789";
const ADMIN: &str = "router-admin-token-0123456789";

fn app() -> axum::Router {
    let config = spendgate_config::load(
        &format!(
            "[server]\nservice_tokens = [\"{SERVICE}\"]\nadmin_tokens = [\"{ADMIN}\"]\n\
             [sessions]\nkeys = [\"router-session-key-0123456789abcdef\"]\n"
        ),
        &|_| None,
    )
    .expect("config");
    let store = Arc::new(spendgate_store::MemoryStore::new(
        config.policy.clone(),
        Arc::new(spendgate_store::SystemClock),
    ));
    let state = spendgate_http::build_state(config, store).expect("state");
    spendgate_http::router(state, axum::Router::new())
}

fn request(method: &str, path: &str) -> axum::http::request::Builder {
    let peer: SocketAddr = "127.0.0.1:40000".parse().expect("addr");
    let mut b = Request::builder().method(method).uri(path);
    if let Some(ext) = b.extensions_mut() {
        ext.insert(ConnectInfo(peer));
    }
    b
}

/// Sends `req` through the router: the status, the body as JSON (null when it is not JSON)
/// and the raw bytes.
async fn send(req: Request<Body>) -> (StatusCode, Value, Vec<u8>) {
    let res = app().oneshot(req).await.expect("infallible");
    let status = res.status();
    let bytes = axum::body::to_bytes(res.into_body(), 1 << 20)
        .await
        .expect("body");
    let json = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    (status, json, bytes.to_vec())
}

/// OpenAI's error shape with `code`, and the type that code has.
fn assert_error(v: &Value, code: ErrorCode) {
    let e = &v["error"];
    assert_eq!(e["code"], code.as_str(), "{v}");
    assert_eq!(e["type"], code.kind(), "{v}");
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert!(e.get("param").is_some(), "{v}");
}

#[tokio::test]
async fn malformed_json_is_an_invalid_request() {
    let req = request("POST", "/v1/runs")
        .header(header::AUTHORIZATION, format!("Bearer {SERVICE}"))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from("{\"session\": "))
        .expect("request");
    let (status, v, _) = send(req).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_error(&v, ErrorCode::InvalidRequest);
}

#[tokio::test]
async fn an_unknown_field_is_an_invalid_request() {
    let req = request("POST", "/v1/runs")
        .header(header::AUTHORIZATION, format!("Bearer {SERVICE}"))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(
            r#"{"session": "s", "client_ip": "127.0.0.1", "conversation": "c", "input_bytes": 1, "extra": 1}"#,
        ))
        .expect("request");
    let (status, v, _) = send(req).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_error(&v, ErrorCode::InvalidRequest);
}

#[tokio::test]
async fn a_body_that_is_not_json_is_415() {
    for (path, auth) in [
        ("/v1/runs", Some(SERVICE)),
        ("/admin/v1/adjustments", Some(ADMIN)),
        ("/v1/sessions", None),
    ] {
        // (a client announces its body: the service and admin routes take a POST without one)
        let mut b = request("POST", path)
            .header(header::CONTENT_TYPE, "text/plain")
            .header(header::CONTENT_LENGTH, "2");
        if let Some(token) = auth {
            b = b.header(header::AUTHORIZATION, format!("Bearer {token}"));
        }
        let (status, v, _) = send(b.body(Body::from("{}")).expect("request")).await;
        assert_eq!(status, StatusCode::UNSUPPORTED_MEDIA_TYPE, "{path}");
        assert_error(&v, ErrorCode::InvalidRequest);
    }
}

#[tokio::test]
async fn a_credentialed_route_without_a_token_is_401() {
    for (method, path) in [
        ("POST", "/v1/runs"),
        ("POST", "/v1/runs/run_x/heartbeat"),
        ("GET", "/admin/v1/summary"),
    ] {
        let req = request(method, path)
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from("{}"))
            .expect("request");
        let (status, v, _) = send(req).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{method} {path}");
        assert_error(&v, ErrorCode::Unauthorized);
    }
    // The service token does not open the admin API.
    let req = request("GET", "/admin/v1/summary")
        .header(header::AUTHORIZATION, format!("Bearer {SERVICE}"))
        .body(Body::empty())
        .expect("request");
    let (status, v, _) = send(req).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_error(&v, ErrorCode::Unauthorized);
}

#[tokio::test]
async fn an_unknown_route_is_404_in_the_error_shape() {
    let req = request("GET", "/v1/nothing-here")
        .body(Body::empty())
        .expect("request");
    let (status, v, _) = send(req).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_error(&v, ErrorCode::NotFound);
}

/// An unknown route, under the decision API's prefix or not, with a token or without: the
/// router's fallback answers 404 `not_found` in the error shape.
#[tokio::test]
async fn an_unknown_route_with_a_token_is_404_in_the_error_shape() {
    for path in [
        "/v1/runs/run_x/nothing",
        "/admin/v1/nothing",
        "/no/such/route",
    ] {
        let req = request("POST", path)
            .header(header::AUTHORIZATION, format!("Bearer {SERVICE}"))
            .body(Body::empty())
            .expect("request");
        let (status, v, _) = send(req).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{path}");
        assert_error(&v, ErrorCode::NotFound);
    }
}

/// A method a route does not take: 405 `invalid_request` in the error shape, with `Allow`
/// naming the methods it does take, on the decision API's routes and the others alike.
#[tokio::test]
async fn a_method_a_route_does_not_take_is_405_in_the_error_shape() {
    for (method, path, allow) in [
        ("DELETE", "/v1/sessions", "POST"),
        ("GET", "/v1/runs", "POST"),
        ("GET", "/v1/steps/stp_x/commit", "POST"),
        ("POST", "/admin/v1/summary", "GET,HEAD"),
        ("POST", "/healthz", "GET,HEAD"),
    ] {
        let req = request(method, path)
            .header(header::AUTHORIZATION, format!("Bearer {SERVICE}"))
            .body(Body::empty())
            .expect("request");
        let res = app().oneshot(req).await.expect("infallible");
        assert_eq!(
            res.status(),
            StatusCode::METHOD_NOT_ALLOWED,
            "{method} {path}"
        );
        let got = res
            .headers()
            .get(header::ALLOW)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        assert_eq!(got.as_deref(), Some(allow), "{method} {path}: Allow");
        let bytes = axum::body::to_bytes(res.into_body(), 1 << 20)
            .await
            .expect("body");
        let v: Value = serde_json::from_slice(&bytes).expect("a JSON body");
        assert_error(&v, ErrorCode::InvalidRequest);
    }
}

/// A path id that does not decode (not UTF-8) is 400 `invalid_request`, naming the
/// parameter; one that decodes but no id could be is 404 `not_found`, as an id never made.
#[tokio::test]
async fn a_bad_path_id_is_refused_in_the_error_shape() {
    for (path, status, code, names) in [
        (
            "/v1/steps/%FF/commit",
            400,
            ErrorCode::InvalidRequest,
            "step_id",
        ),
        (
            "/v1/runs/%FF/heartbeat",
            400,
            ErrorCode::InvalidRequest,
            "run_id",
        ),
        (
            "/v1/steps/stp%20x/release",
            404,
            ErrorCode::NotFound,
            "step",
        ),
        ("/v1/runs/run%2Fx/finish", 404, ErrorCode::NotFound, "run"),
    ] {
        let req = request("POST", path)
            .header(header::AUTHORIZATION, format!("Bearer {SERVICE}"))
            .body(Body::empty())
            .expect("request");
        let (got, v, _) = send(req).await;
        assert_eq!(got.as_u16(), status, "{path}: {v}");
        assert_error(&v, code);
        let message = v["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(names), "{path}: {message}");
    }
}

/// A query parameter that does not parse, or one the route does not know, is 400
/// `invalid_request` in the error shape, its message naming the parameter.
#[tokio::test]
async fn a_bad_query_value_is_400_in_the_error_shape() {
    for (path, token, names) in [
        ("/admin/v1/reservations?limit=many", ADMIN, "limit"),
        ("/admin/v1/scopes?top=-1", ADMIN, "top"),
        ("/v1/usage?session=x&bogus=1", SERVICE, "bogus"),
        ("/admin/v1/history?since=soon", ADMIN, "since"),
        ("/admin/v1/history?until=2026-02-30", ADMIN, "until"),
        (
            "/admin/v1/history?since=2026-12-03&until=2026-12-02",
            ADMIN,
            "since",
        ),
        ("/admin/v1/history?by=planet", ADMIN, "by"),
        ("/admin/v1/history?kind=everything", ADMIN, "kind"),
        ("/admin/v1/history?kind=runs&by=model", ADMIN, "by"),
        (
            "/admin/v1/history?kind=refusals&by=model",
            ADMIN,
            "refusals",
        ),
        ("/admin/v1/history?state=gone", ADMIN, "state"),
        ("/admin/v1/history?limit=0", ADMIN, "limit"),
        ("/admin/v1/history?limit=10001", ADMIN, "limit"),
        ("/admin/v1/history?cursor=nope", ADMIN, "cursor"),
        ("/admin/v1/history?top=-1", ADMIN, "top"),
        ("/admin/v1/history?bogus=1", ADMIN, "bogus"),
    ] {
        let req = request("GET", path)
            .header(header::AUTHORIZATION, format!("Bearer {token}"))
            .body(Body::empty())
            .expect("request");
        let (status, v, _) = send(req).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{path}: {v}");
        assert_error(&v, ErrorCode::InvalidRequest);
        let message = v["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(names), "{path}: {message}");
    }
}

/// The usage history is the admin's: no token, no answer.
#[tokio::test]
async fn the_history_needs_the_admin_token() {
    for token in [None, Some(SERVICE)] {
        let mut req = request("GET", "/admin/v1/history?by=model");
        if let Some(t) = token {
            req = req.header(header::AUTHORIZATION, format!("Bearer {t}"));
        }
        let (status, v, _) = send(req.body(Body::empty()).expect("request")).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{v}");
        assert_error(&v, ErrorCode::Unauthorized);
    }
}

/// The API document is served without a token, and it is the one the code generates.
#[tokio::test]
async fn the_document_is_served_unauthenticated() {
    let req = request("GET", "/openapi.json")
        .body(Body::empty())
        .expect("request");
    let (status, v, bytes) = send(req).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(bytes, spendgate_http::openapi::document().into_bytes());
    assert!(v["paths"]["/v1/runs"]["post"].is_object(), "{v}");
}

/// A body over the decision API's limit (`DefaultBodyLimit`, the larger of
/// `API_BODY_BYTES_MAX` and twice the run's input bound) is 413 `payload_too_large` in the
/// error shape: the JSON extractor maps the framework's refusal, nothing rewrites it later.
#[tokio::test]
async fn a_body_over_the_limit_is_413_in_the_error_shape() {
    let bounds = spendgate_core::RunBounds::default();
    let limit = spendgate_http::body::API_BODY_BYTES_MAX
        .max(usize::try_from(bounds.max_input_bytes).expect("fits") * 2 + 4096);
    let req = request("POST", "/v1/runs")
        .header(header::AUTHORIZATION, format!("Bearer {SERVICE}"))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(vec![b' '; limit + 1]))
        .expect("request");
    let (status, v, _) = send(req).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{v}");
    assert_error(&v, ErrorCode::PayloadTooLarge);
}
