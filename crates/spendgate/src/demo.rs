//! `spendgate demo`: the gateway, the built-in mock upstream (in this process, on a free
//! loopback port, registered as upstream `"mock"`) and a demo chat page at `/demo/`, on the
//! embedded sqlite store, with no config file.
//!
//! The page creates a guest session (cookie) and calls `/v1/chat/completions` with the cookie
//! alone (`server.browser_direct = true`; `sessions.secure_cookie = false` for plain HTTP).

use anyhow::Context;
use axum::http::header;
use axum::response::{Html, IntoResponse, Redirect};
use axum::routing::get;
use axum::Json;
use serde_json::json;
use spendgate_config::{self as config, MOCK_UPSTREAM};
use spendgate_http::Upstream;
use spendgate_mock_upstream::{MockConfig, MockUpstream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// How long the demo waits for its own mock upstream.
const MOCK_TIMEOUT: Duration = Duration::from_secs(30);

/// The demo's config: small budgets so that refusals are easy to see (`demo.toml`, its
/// placeholders filled in).
fn demo_config(listen: &str, db: &str, admin: &str, service: &str, key: &str) -> String {
    let values = [
        ("{listen}", listen),
        ("{db}", db),
        ("{admin}", admin),
        ("{service}", service),
        ("{key}", key),
        ("{MOCK_UPSTREAM}", MOCK_UPSTREAM),
    ];
    // One pass: a value is never read again as a placeholder.
    let mut out = String::new();
    let mut rest = include_str!("demo.toml");
    while let Some(i) = rest.find('{') {
        out.push_str(&rest[..i]);
        rest = &rest[i..];
        match values.iter().find(|(k, _)| rest.starts_with(k)) {
            Some((k, v)) => {
                out.push_str(v);
                rest = &rest[k.len()..];
            }
            None => {
                out.push('{');
                rest = &rest[1..];
            }
        }
    }
    out.push_str(rest);
    out
}

fn random_hex(bytes: usize) -> String {
    let mut out = String::with_capacity(bytes * 2);
    for _ in 0..bytes {
        out.push_str(&format!("{:02x}", rand::random::<u8>()));
    }
    out
}

/// Removes the demo's database files when the demo made them.
struct TempDb(Option<PathBuf>);

impl Drop for TempDb {
    fn drop(&mut self) {
        if let Some(p) = &self.0 {
            for suffix in ["", "-wal", "-shm", "-journal"] {
                let mut f = p.clone().into_os_string();
                f.push(suffix);
                let _ = std::fs::remove_file(PathBuf::from(f));
            }
        }
    }
}

pub async fn run(
    listen: String,
    db: Option<PathBuf>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    // The mock upstream: answers at a readable pace so streaming shows.
    let mock = MockUpstream::new(MockConfig {
        tokens_per_second: 60,
        completion_tokens: 48,
        ..MockConfig::default()
    });
    let mock_listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .context("binding the mock upstream")?;
    let mock_addr = mock_listener.local_addr()?;
    let mock_task = tokio::spawn(mock.serve(mock_listener));

    let (db_path, _cleanup) = match db {
        Some(p) => (p, TempDb(None)),
        None => {
            let p = std::env::temp_dir().join(format!("spendgate-demo-{}.db", std::process::id()));
            (p.clone(), TempDb(Some(p)))
        }
    };
    let db_text = db_path
        .to_str()
        .context("the demo database path must be UTF-8")?
        .replace('\\', "\\\\")
        .replace('"', "\\\"");
    let admin = format!("demo-admin-{}", random_hex(12));
    let service = format!("demo-service-{}", random_hex(12));
    let text = demo_config(&listen, &db_text, &admin, &service, &random_hex(32));
    let cfg = config::load(&text, &|_| None).map_err(|e| anyhow::anyhow!("demo config: {e}"))?;
    let models: Vec<String> = cfg.models.keys().cloned().collect();
    let served = models.join(", ");

    spendgate_tokens::warm_up();
    let store = spendgate_http::open_store(&cfg).await?;
    let listener = spendgate_listener::bind(cfg.server.listen)
        .with_context(|| format!("binding {}", cfg.server.listen))?;
    let addr = listener.local_addr()?;
    let mut state = spendgate_http::build_state(cfg, store)?;
    Arc::get_mut(&mut state)
        .context("the new state is not shared yet")?
        .upstreams
        .insert(
            MOCK_UPSTREAM.to_string(),
            Upstream {
                base_url: format!("http://{mock_addr}/v1"),
                api_key: String::new(),
                timeout: MOCK_TIMEOUT,
                release_on_error: true,
            },
        );

    // The demo's pages are public routes like the others, behind the same bounds.
    let pages = axum::Router::new()
        .route("/", get(|| async { Redirect::temporary("/demo/") }))
        .route("/demo", get(|| async { Redirect::temporary("/demo/") }))
        .route("/demo/", get(page))
        .route(
            "/demo/models",
            get(move || {
                let models = models.clone();
                async move { Json(json!({ "models": models })) }
            }),
        );
    let app = spendgate_http::router(state.clone(), spendgate_proxy::routes().merge(pages));

    println!("spendgate demo: open http://{addr}/demo/");
    println!("  operator dashboard: http://{addr}/admin/  (admin token: {admin})");
    println!("  OpenAI-compatible base URL: http://{addr}/v1  (service token: {service})");
    println!("  models: {served} (on /v1/chat/completions, /v1/responses, /v1/embeddings and /v1/messages)");
    println!("  built-in mock upstream: http://{mock_addr}/v1  (stats: /mock/stats)");
    println!("  ledger: {}", db_path.display());
    tracing::info!(%addr, %mock_addr, "spendgate demo listening");

    // As `serve` does: the sweeper, the alert checker (alerts, and the burn rates the
    // dashboard's forecast shows) and the policy publisher run beside the listener. (Its idle
    // time follows the longest upstream timeout: the mock's.)
    let result = spendgate_http::serve::serve(state, app, listener, shutdown).await;
    mock_task.abort();
    result.context("serving the demo")
}

async fn page() -> impl IntoResponse {
    (
        [(header::CACHE_CONTROL, "no-store")],
        Html(include_str!("demo.html")),
    )
}

/// `spendgate mock-upstream`: the OpenAI-compatible mock upstream (as the `mock-upstream`
/// binary of `spendgate-mock-upstream`).
pub async fn mock_upstream(
    listen: &str,
    latency_ms: u64,
    tokens_per_second: u64,
) -> anyhow::Result<()> {
    let mock = MockUpstream::new(MockConfig {
        latency_ms,
        tokens_per_second,
        ..Default::default()
    });
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("binding {listen}"))?;
    println!(
        "mock upstream listening on http://{}",
        listener.local_addr()?
    );
    mock.serve(listener).await?;
    Ok(())
}
