//! The `ratelimit-sidecar` binary: parse flags, set up logging to stderr, serve until SIGINT or
//! SIGTERM.

use anyhow::Context;
use clap::Parser;
use ratelimit_sidecar::{serve, Args};
use tracing_subscriber::EnvFilter;

// Every decision allocates (JSON, keys, script arguments) on several threads: mimalloc spends
// less CPU there than the system allocator (profiled: malloc and free were about an eighth of
// the sidecar's CPU under load).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.worker_threads as usize)
        .enable_all()
        .build()
        .context("cannot start the async runtime")?
        .block_on(run(args))
}

async fn run(args: Args) -> anyhow::Result<()> {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let logs = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(filter);
    if args.log_format == "json" {
        // One JSON object per line (timestamp, level, target, message, fields), for log pipelines.
        logs.json().flatten_event(true).init();
    } else {
        logs.init();
    }
    ratelimit_sidecar::check_listen(&args)?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on --listen {}", args.listen))?;
    serve(args, listener, shutdown_signal()).await?;
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => return ctrl_c.await.unwrap_or_default(),
            };
        tokio::select! {
            _ = ctrl_c => {},
            _ = term.recv() => {},
        }
    }
    #[cfg(not(unix))]
    ctrl_c.await.unwrap_or_default();
}
