//! `warmpath-engine`: parse flags, start the engine, serve until SIGINT/SIGTERM.

use clap::Parser;
use warmpath_engine::config::EngineArgs;

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let args = EngineArgs::parse();
    args.validate().map_err(anyhow::Error::msg)?;
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async {
        let server = warmpath_engine::launch(args).await?;
        println!("warmpath-engine serving model {:?} on http://{}", server.model_name, server.addr);
        if let Some(ep) = &server.kv_events_endpoint {
            println!("KV events published on {ep}");
        }
        if let Some(ep) = &server.kv_events_replay_endpoint {
            println!("KV event replay on {ep}");
        }
        server.run_until(shutdown_signal()).await
    })
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(s) => s,
            Err(_) => return ctrl_c.await.unwrap_or(()),
        };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    ctrl_c.await.unwrap_or(());
}
