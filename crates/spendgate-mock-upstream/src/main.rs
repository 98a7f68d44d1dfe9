//! `mock-upstream`: the OpenAI-compatible mock upstream as a process of its own, for the
//! benchmark scripts and manual tests (the same server as `spendgate mock-upstream`). It is
//! not part of a production build of spendgate.

use clap::Parser;
use spendgate_mock_upstream::{MockConfig, MockUpstream};

/// Run the OpenAI-compatible mock upstream.
#[derive(Parser)]
#[command(name = "mock-upstream", version)]
struct Args {
    #[arg(long, default_value = "127.0.0.1:8090")]
    listen: String,
    #[arg(long, default_value_t = 0)]
    latency_ms: u64,
    #[arg(long, default_value_t = 0)]
    tokens_per_second: u64,
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let args = Args::parse();
    let mock = MockUpstream::new(MockConfig {
        latency_ms: args.latency_ms,
        tokens_per_second: args.tokens_per_second,
        ..MockConfig::default()
    });
    let listener = tokio::net::TcpListener::bind(&args.listen)
        .await
        .map_err(|e| std::io::Error::new(e.kind(), format!("binding {}: {e}", args.listen)))?;
    println!(
        "mock upstream listening on http://{}",
        listener.local_addr()?
    );
    mock.serve(listener).await
}
