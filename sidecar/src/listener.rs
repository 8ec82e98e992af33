//! The sidecar's listeners: the accept loop, TLS (rustls; client certificates required and
//! verified when `--tls-client-ca` is set) and HTTP/1.1 + HTTP/2 on every connection
//! (hyper-util's auto builder: ALPN `h2`/`http/1.1` on TLS, HTTP/1.1 or h2c prior knowledge on
//! plain TCP), until shutdown, after which open connections are drained gracefully.
//!
//! A TLS handshake runs in the connection's own task, bounded by [`TLS_HANDSHAKE_TIMEOUT`], so a
//! slow or silent client never holds up the accept loop.

use std::future::Future;
use std::io::BufReader;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;

/// Upper bound of one TLS handshake.
pub const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// A PEM file that cannot serve; the message names the flag and the path.
#[derive(Debug, thiserror::Error)]
pub enum TlsConfigError {
    #[error("{flag} {}: cannot read it: {source}", path.display())]
    Read {
        flag: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{flag} {}: {what}", path.display())]
    Pem {
        flag: &'static str,
        path: PathBuf,
        what: String,
    },
    #[error("--tls-key {}: does not match the certificate of --tls-cert {}: {source}", key.display(), cert.display())]
    KeyMismatch {
        cert: PathBuf,
        key: PathBuf,
        source: rustls::Error,
    },
}

/// Installs rustls's `ring` provider as the process default (once; later calls do nothing), so
/// every rustls user in the process (the listener, the Redis client) agrees on it.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

fn read(flag: &'static str, path: &Path) -> Result<Vec<u8>, TlsConfigError> {
    std::fs::read(path).map_err(|source| TlsConfigError::Read {
        flag,
        path: path.to_path_buf(),
        source,
    })
}

/// Every certificate of a PEM file (at least one).
pub fn read_certificates(
    flag: &'static str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, TlsConfigError> {
    let pem = read(flag, path)?;
    let bad = |what: String| TlsConfigError::Pem {
        flag,
        path: path.to_path_buf(),
        what,
    };
    let certs = CertificateDer::pem_reader_iter(&mut BufReader::new(&pem[..]))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(format!("not a PEM certificate file: {e}")))?;
    if certs.is_empty() {
        return Err(bad(
            "no certificate in it (expected PEM `-----BEGIN CERTIFICATE-----` blocks)".into(),
        ));
    }
    Ok(certs)
}

/// The private key of a PEM file (PKCS#8, PKCS#1 or SEC1).
pub fn read_private_key(
    flag: &'static str,
    path: &Path,
) -> Result<PrivateKeyDer<'static>, TlsConfigError> {
    let pem = read(flag, path)?;
    PrivateKeyDer::from_pem_slice(&pem).map_err(|e| TlsConfigError::Pem {
        flag,
        path: path.to_path_buf(),
        what: format!("no PEM private key in it: {e}"),
    })
}

/// The TLS acceptor of `--tls-cert`/`--tls-key`, requiring client certificates signed by
/// `--tls-client-ca` when given. ALPN offers `h2` and `http/1.1`.
pub fn tls_acceptor(
    cert: &Path,
    key: &Path,
    client_ca: Option<&Path>,
) -> Result<TlsAcceptor, TlsConfigError> {
    install_crypto_provider();
    let chain = read_certificates("--tls-cert", cert)?;
    let private_key = read_private_key("--tls-key", key)?;
    let builder = ServerConfig::builder();
    let builder = match client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = RootCertStore::empty();
            for c in read_certificates("--tls-client-ca", ca)? {
                roots.add(c).map_err(|e| TlsConfigError::Pem {
                    flag: "--tls-client-ca",
                    path: ca.to_path_buf(),
                    what: format!("not a usable CA certificate: {e}"),
                })?;
            }
            let verifier = WebPkiClientVerifier::builder(Arc::new(roots))
                .build()
                .map_err(|e| TlsConfigError::Pem {
                    flag: "--tls-client-ca",
                    path: ca.to_path_buf(),
                    what: format!("cannot verify client certificates with it: {e}"),
                })?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder
        .with_single_cert(chain, private_key)
        .map_err(|source| TlsConfigError::KeyMismatch {
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
            source,
        })?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// The HTTP/2 connection window (hyper's default: 1 MiB; a stream's stays 1 MiB). h2 closes a
/// connection whose unread small DATA frames cost more than half of it in framing overhead
/// (GOAWAY `too_many_data_frames`): Envoy reports each new RLQS bucket in a frame of its own, and
/// a burst of new clients on a sidecar short of CPU reached the default's ~2,700 frames; 4 MiB
/// holds ~11,000 (docs/rlqs.md, "Reports of any size").
const HTTP2_CONNECTION_WINDOW_BYTES: u32 = 4 << 20;

/// What one listener allows a client connection (`--header-timeout-ms`, `--max-connections`).
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    /// Time to send a request's headers (idle keep-alive time included), HTTP/1.1.
    pub header_timeout: Duration,
    /// Connections served at once.
    pub max_connections: usize,
}

/// Serves `app` on `listener` (through `tls` when given) until `shutdown` completes, then stops
/// accepting and waits for the open connections to finish their requests (idle HTTP/1.1
/// connections are closed, HTTP/2 connections get a GOAWAY).
pub async fn serve(
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    app: Router,
    limits: ConnectionLimits,
    shutdown: impl Future<Output = ()> + Send,
) -> std::io::Result<()> {
    let graceful = GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    let slots = Arc::new(tokio::sync::Semaphore::new(limits.max_connections));
    let mut last_refusal_log: Option<std::time::Instant> = None;
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors and the like: wait a little instead of spinning.
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = shutdown.as_mut() => break,
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            // Over the limit: closed at once (dropping the stream), logged now and then.
            if last_refusal_log.is_none_or(|t| t.elapsed() >= Duration::from_secs(10)) {
                tracing::warn!(
                    %peer,
                    max_connections = limits.max_connections,
                    "connection refused: --max-connections reached"
                );
                last_refusal_log = Some(std::time::Instant::now());
            }
            continue;
        };
        let _ = stream.set_nodelay(true);
        let app = app.clone();
        let watcher = graceful.watcher();
        let tls = tls.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let service = TowerToHyperService::new(app);
            let mut builder = auto::Builder::new(TokioExecutor::new());
            builder
                .http1()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_timeout);
            builder
                .http2()
                .initial_connection_window_size(HTTP2_CONNECTION_WINDOW_BYTES);
            let result = match tls {
                None => {
                    let conn =
                        builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
                    watcher.watch(conn.into_owned()).await
                }
                Some(acceptor) => {
                    let Some(stream) = handshake(&acceptor, stream, peer).await else {
                        return;
                    };
                    let conn =
                        builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
                    watcher.watch(conn.into_owned()).await
                }
            };
            if let Err(e) = result {
                tracing::debug!(%peer, "connection ended: {e}");
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

async fn handshake(
    acceptor: &TlsAcceptor,
    stream: TcpStream,
    peer: SocketAddr,
) -> Option<tokio_rustls::server::TlsStream<TcpStream>> {
    match tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
        Ok(Ok(s)) => Some(s),
        Ok(Err(e)) => {
            // A caller without a valid client certificate, or speaking plain HTTP to TLS.
            tracing::info!(%peer, "TLS handshake refused: {e}");
            None
        }
        Err(_) => {
            tracing::info!(%peer, "TLS handshake took longer than {TLS_HANDSHAKE_TIMEOUT:?}");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_and_non_pem_files_are_named_by_flag_and_path() {
        let e = tls_acceptor(Path::new("/nonexistent/cert.pem"), Path::new("/k"), None)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.starts_with("--tls-cert /nonexistent/cert.pem: cannot read it"),
            "{e}"
        );
        let junk = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(junk.path(), "not a certificate\n").unwrap();
        let e = tls_acceptor(junk.path(), junk.path(), None)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.starts_with("--tls-cert ") && e.contains("no certificate"),
            "{e}"
        );
        let e = read_private_key("--tls-key", junk.path())
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.starts_with("--tls-key ") && e.contains("no PEM private key"),
            "{e}"
        );
    }
}
