//! Who may ask for decisions: the bearer tokens of `--auth-token-file` and
//! `RATELIMIT_AUTH_TOKEN`, checked on every request except the open paths (`/healthz`, `/readyz`,
//! `/metrics`).
//!
//! Tokens are kept as SHA-256 digests and a presented token is compared, digest to digest, in
//! constant time ([`subtle`]) against every configured one: neither the position of a wrong byte
//! nor a token's length shows in the time an answer takes. The file is re-read when it changes
//! (its modification time, size or inode), so a token is rotated by adding the new one, moving the
//! callers over, and removing the old one, without a restart.
//!
//! [`Auth::check`] takes the request's headers and is the whole API a server needs (the gRPC
//! service on the same listener reads the same `authorization` header); [`protect`] wraps an axum
//! router with it, and leaves the accepted token's [`Credential`] in the request's extensions, so
//! that a call that outlives a rotation (a quota stream) can ask whether it is still accepted.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use ratelimit_wire::ErrorBody;
use sha2::{Digest as _, Sha256};
use subtle::ConstantTimeEq;

use crate::metrics::{CallOutcome, Metrics};
use crate::secret::Secret;

/// Paths anyone may call: probes and Prometheus cannot present credentials.
pub const OPEN_PATHS: [&str; 3] = ["/healthz", "/readyz", "/metrics"];

/// How often the token file is checked for changes.
pub const TOKEN_FILE_CHECK_INTERVAL: Duration = Duration::from_secs(2);

type TokenDigest = [u8; 32];

fn digest(token: &[u8]) -> TokenDigest {
    Sha256::digest(token).into()
}

/// A token configuration that cannot be used. Never shows a token.
#[derive(Debug, thiserror::Error)]
pub enum AuthConfigError {
    #[error("--auth-token-file {path}: cannot read it: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "--auth-token-file {path}: no token in the file (one token per line; blank lines and \
         lines starting with # are ignored)"
    )]
    Empty { path: PathBuf },
    #[error(
        "--auth-token-file {path}: line {line}: a token must be printable ASCII without spaces \
         (it travels in `authorization: Bearer <token>`)"
    )]
    BadToken { path: PathBuf, line: usize },
    #[error(
        "RATELIMIT_AUTH_TOKEN (--auth-token): a token must be printable ASCII without spaces \
         (it travels in `authorization: Bearer <token>`)"
    )]
    BadInlineToken,
}

/// Why a request is not let through. The message names what is wrong, never the token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error("missing credentials: send `authorization: Bearer <token>`")]
    Missing,
    #[error("the authorization header is not `Bearer <token>`")]
    NotBearer,
    #[error("invalid bearer token")]
    Invalid,
}

impl AuthError {
    /// `WWW-Authenticate` as RFC 6750 section 3 has it.
    fn challenge(self) -> &'static str {
        match self {
            AuthError::Missing => "Bearer realm=\"ratelimit\"",
            AuthError::NotBearer => "Bearer realm=\"ratelimit\", error=\"invalid_request\"",
            AuthError::Invalid => "Bearer realm=\"ratelimit\", error=\"invalid_token\"",
        }
    }
}

impl IntoResponse for AuthError {
    /// 401 with a `WWW-Authenticate: Bearer` challenge and `{"error":"..."}`.
    fn into_response(self) -> Response {
        let mut r = (
            StatusCode::UNAUTHORIZED,
            Json(ErrorBody {
                error: self.to_string(),
            }),
        )
            .into_response();
        r.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            HeaderValue::from_static(self.challenge()),
        );
        r
    }
}

/// The token a request was accepted with, as its digest: whether it is still one of the tokens
/// can be asked later (a rotation of `--auth-token-file` removes it). Never shows the token.
#[derive(Clone)]
pub struct Credential {
    auth: Arc<Auth>,
    digest: TokenDigest,
}

impl Credential {
    /// Whether the token is still accepted: the token file's last reload (every
    /// [`TOKEN_FILE_CHECK_INTERVAL`]) still holds it, or it is `RATELIMIT_AUTH_TOKEN`.
    pub fn still_accepted(&self) -> bool {
        self.auth.accepts_digest(&self.digest)
    }
}

impl std::fmt::Debug for Credential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Credential(<redacted>)")
    }
}

/// The bearer tokens callers must present.
pub struct Auth {
    /// From `RATELIMIT_AUTH_TOKEN` / `--auth-token`.
    inline: Option<TokenDigest>,
    file: Option<TokenFile>,
}

struct TokenFile {
    path: PathBuf,
    state: RwLock<FileTokens>,
}

struct FileTokens {
    digests: Arc<[TokenDigest]>,
    stamp: Option<Stamp>,
}

/// What tells a changed file: modification time, size and inode (a Kubernetes Secret volume
/// swaps a symlink, which changes the inode the path resolves to).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Stamp {
    modified: Option<SystemTime>,
    len: u64,
    inode: u64,
}

fn stamp(path: &Path) -> std::io::Result<Stamp> {
    let m = std::fs::metadata(path)?;
    #[cfg(unix)]
    let inode = std::os::unix::fs::MetadataExt::ino(&m);
    #[cfg(not(unix))]
    let inode = 0;
    Ok(Stamp {
        modified: m.modified().ok(),
        len: m.len(),
        inode,
    })
}

/// The tokens of a token file's text: one per line, blank lines and `#` comments ignored,
/// surrounding whitespace trimmed.
fn parse_token_file(path: &Path, text: &str) -> Result<Vec<TokenDigest>, AuthConfigError> {
    let mut digests = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let token = line.trim();
        if token.is_empty() || token.starts_with('#') {
            continue;
        }
        if !valid_token(token) {
            return Err(AuthConfigError::BadToken {
                path: path.to_path_buf(),
                line: i + 1,
            });
        }
        digests.push(digest(token.as_bytes()));
    }
    if digests.is_empty() {
        return Err(AuthConfigError::Empty {
            path: path.to_path_buf(),
        });
    }
    Ok(digests)
}

fn valid_token(token: &str) -> bool {
    !token.is_empty() && token.bytes().all(|b| b.is_ascii_graphic())
}

fn read_token_file(path: &Path) -> Result<(Vec<TokenDigest>, Stamp), AuthConfigError> {
    let read = |source| AuthConfigError::Read {
        path: path.to_path_buf(),
        source,
    };
    let before = stamp(path).map_err(read)?;
    let text = std::fs::read_to_string(path).map_err(read)?;
    Ok((parse_token_file(path, &text)?, before))
}

impl Auth {
    /// The tokens of `--auth-token-file` and `RATELIMIT_AUTH_TOKEN`; `None` when neither is set
    /// (callers are not asked for a token).
    pub fn load(
        token_file: Option<&Path>,
        token: Option<&Secret>,
    ) -> Result<Option<Arc<Auth>>, AuthConfigError> {
        let inline = match token {
            None => None,
            Some(t) if valid_token(t.expose()) => Some(digest(t.expose().as_bytes())),
            Some(_) => return Err(AuthConfigError::BadInlineToken),
        };
        let file = match token_file {
            None => None,
            Some(path) => {
                let (digests, stamp) = read_token_file(path)?;
                Some(TokenFile {
                    path: path.to_path_buf(),
                    state: RwLock::new(FileTokens {
                        digests: digests.into(),
                        stamp: Some(stamp),
                    }),
                })
            }
        };
        if inline.is_none() && file.is_none() {
            return Ok(None);
        }
        Ok(Some(Arc::new(Auth { inline, file })))
    }

    /// Accepts the request when its `authorization` header is `Bearer <one of the tokens>`.
    pub fn check(&self, headers: &HeaderMap) -> Result<(), AuthError> {
        self.presented(headers).map(|_| ())
    }

    /// [`Auth::check`], and the credential the request was accepted with.
    pub fn authenticate(self: &Arc<Self>, headers: &HeaderMap) -> Result<Credential, AuthError> {
        Ok(Credential {
            auth: self.clone(),
            digest: self.presented(headers)?,
        })
    }

    /// The digest of the presented token, when it is one of the tokens.
    fn presented(&self, headers: &HeaderMap) -> Result<TokenDigest, AuthError> {
        let value = headers
            .get(header::AUTHORIZATION)
            .ok_or(AuthError::Missing)?;
        let value = value.to_str().map_err(|_| AuthError::NotBearer)?;
        let (scheme, token) = value.trim().split_once(' ').ok_or(AuthError::NotBearer)?;
        if !scheme.eq_ignore_ascii_case("bearer") {
            return Err(AuthError::NotBearer);
        }
        let presented = digest(token.trim().as_bytes());
        if self.accepts_digest(&presented) {
            Ok(presented)
        } else {
            Err(AuthError::Invalid)
        }
    }

    /// Whether `presented` is the digest of one of the tokens: every configured digest is
    /// compared, in constant time, whatever matched before.
    fn accepts_digest(&self, presented: &TokenDigest) -> bool {
        let mut ok = subtle::Choice::from(0u8);
        if let Some(d) = &self.inline {
            ok |= d.ct_eq(presented);
        }
        if let Some(f) = &self.file {
            let digests = f.state.read().expect("not poisoned").digests.clone();
            for d in digests.iter() {
                ok |= d.ct_eq(presented);
            }
        }
        ok.into()
    }

    /// Re-reads the token file if it changed. A file that cannot be read or holds no valid
    /// token leaves the current tokens in place (a rotation caught half-written must not lock
    /// every caller out) and is reported.
    pub fn reload_if_changed(&self) -> Result<bool, AuthConfigError> {
        let Some(f) = &self.file else {
            return Ok(false);
        };
        let now = stamp(&f.path).map_err(|source| AuthConfigError::Read {
            path: f.path.clone(),
            source,
        })?;
        if f.state.read().expect("not poisoned").stamp.as_ref() == Some(&now) {
            return Ok(false);
        }
        let result = read_token_file(&f.path);
        let mut state = f.state.write().expect("not poisoned");
        match result {
            Ok((digests, stamp)) => {
                state.digests = digests.into();
                state.stamp = Some(stamp);
                Ok(true)
            }
            Err(e) => {
                // Remember the stamp, so a bad file is reported once, not every interval.
                state.stamp = Some(now);
                Err(e)
            }
        }
    }

    /// Checks the token file every `every` until the task is aborted, logging each reload.
    pub fn watch_token_file(
        self: Arc<Self>,
        every: Duration,
    ) -> Option<tokio::task::JoinHandle<()>> {
        let path = self.file.as_ref()?.path.clone();
        Some(tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                match self.reload_if_changed() {
                    Ok(true) => {
                        tracing::info!(path = %path.display(), "--auth-token-file reloaded")
                    }
                    Ok(false) => {}
                    Err(e) => tracing::warn!("{e}; keeping the tokens read before"),
                }
            }
        }))
    }
}

/// Wraps `router` so that every request but those to [`OPEN_PATHS`] must pass [`Auth::check`];
/// the others are answered 401 before any handler (or body read) runs, so they consume nothing,
/// and each is counted in `metrics` as an `unauthorized` call of the API its path names.
pub fn protect(router: Router, auth: Arc<Auth>, metrics: Arc<Metrics>) -> Router {
    router.layer(middleware::from_fn_with_state(
        (auth, metrics),
        require_bearer,
    ))
}

/// The `api` label of a call to `path` (docs/observability.md, `ratelimit_calls_total`): any
/// gRPC call but the stream per worker's is `grpc`, any path but settlements' and slots' `http`.
fn api_of(path: &str, grpc: bool) -> &'static str {
    match path {
        ratelimit_wire::stream::STREAM_PATH => "stream",
        _ if grpc => "grpc",
        "/v1/settle" => "settle",
        "/v1/slots" => "slots",
        _ => "http",
    }
}

/// Wraps `router` so that it answers only [`OPEN_PATHS`] (404 for everything else): the admin
/// listener's routes.
pub fn open_paths_only(router: Router) -> Router {
    router.layer(middleware::from_fn(only_open_paths))
}

async fn only_open_paths(request: Request, next: Next) -> Response {
    if OPEN_PATHS.contains(&request.uri().path()) {
        return next.run(request).await;
    }
    (
        StatusCode::NOT_FOUND,
        Json(ErrorBody {
            error: "the admin listener serves only /healthz, /readyz and /metrics".into(),
        }),
    )
        .into_response()
}

async fn require_bearer(
    State((auth, metrics)): State<(Arc<Auth>, Arc<Metrics>)>,
    mut request: Request,
    next: Next,
) -> Response {
    let path = request.uri().path();
    if OPEN_PATHS.contains(&path) {
        return next.run(request).await;
    }
    match auth.authenticate(request.headers()) {
        Ok(credential) => {
            request.extensions_mut().insert(credential);
            next.run(request).await
        }
        Err(e) => {
            let grpc = is_grpc(request.headers());
            metrics.call(api_of(path, grpc), CallOutcome::Unauthorized);
            if grpc {
                return grpc_unauthenticated(e);
            }
            tracing::debug!(path, "refused: {e}");
            e.into_response()
        }
    }
}

fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/grpc"))
}

/// A gRPC "trailers-only" answer: status 16 (UNAUTHENTICATED).
fn grpc_unauthenticated(e: AuthError) -> Response {
    let mut r = StatusCode::OK.into_response();
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    h.insert("grpc-status", HeaderValue::from_static("16"));
    if let Ok(message) = HeaderValue::from_str(&e.to_string()) {
        h.insert("grpc-message", message);
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(authorization: Option<&str>) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Some(v) = authorization {
            h.insert(header::AUTHORIZATION, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    fn file(text: &str) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(f.path(), text).unwrap();
        f
    }

    #[test]
    fn a_token_file_holds_several_tokens_with_comments_and_blank_lines() {
        let f = file("# rotated 2024-05\n\n  old-token  \nnew-token\n");
        let auth = Auth::load(Some(f.path()), None).unwrap().unwrap();
        assert_eq!(auth.check(&headers(Some("Bearer old-token"))), Ok(()));
        assert_eq!(auth.check(&headers(Some("bearer new-token"))), Ok(()));
        assert_eq!(
            auth.check(&headers(Some("Bearer # rotated 2024-05"))),
            Err(AuthError::Invalid)
        );
        assert_eq!(
            auth.check(&headers(Some("Bearer "))),
            Err(AuthError::NotBearer)
        );
    }

    #[test]
    fn wrong_missing_and_non_bearer_credentials_are_told_apart() {
        let auth = Auth::load(None, Some(&Secret::new("s3cret")))
            .unwrap()
            .unwrap();
        assert_eq!(auth.check(&headers(Some("Bearer s3cret"))), Ok(()));
        assert_eq!(auth.check(&headers(None)), Err(AuthError::Missing));
        assert_eq!(
            auth.check(&headers(Some("Basic czNjcmV0"))),
            Err(AuthError::NotBearer)
        );
        assert_eq!(
            auth.check(&headers(Some("s3cret"))),
            Err(AuthError::NotBearer)
        );
        for wrong in ["Bearer s3cre", "Bearer s3cret2", "Bearer S3CRET"] {
            assert_eq!(
                auth.check(&headers(Some(wrong))),
                Err(AuthError::Invalid),
                "{wrong}"
            );
        }
    }

    #[test]
    fn no_token_configured_means_no_check() {
        assert!(Auth::load(None, None).unwrap().is_none());
    }

    #[test]
    fn unusable_token_files_are_refused_naming_flag_path_and_line() {
        let empty = file("# nothing yet\n\n");
        let e = Auth::load(Some(empty.path()), None)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("--auth-token-file") && e.contains("no token"),
            "{e}"
        );
        assert!(e.contains(&empty.path().display().to_string()), "{e}");
        let spaced = file("good\nbad token\n");
        let e = Auth::load(Some(spaced.path()), None)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("line 2") && !e.contains("bad token"), "{e}");
        let e = Auth::load(Some(Path::new("/nonexistent/tokens")), None)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("--auth-token-file /nonexistent/tokens: cannot read"),
            "{e}"
        );
        let e = Auth::load(None, Some(&Secret::new("a b")))
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("RATELIMIT_AUTH_TOKEN") && !e.contains("a b"),
            "{e}"
        );
    }

    #[test]
    fn a_rotated_file_is_reloaded_and_a_broken_one_keeps_the_old_tokens() {
        let f = file("first\n");
        let auth = Auth::load(Some(f.path()), None).unwrap().unwrap();
        assert!(!auth.reload_if_changed().unwrap());
        std::fs::write(f.path(), "first\nsecond-token\n").unwrap();
        assert!(auth.reload_if_changed().unwrap());
        assert_eq!(auth.check(&headers(Some("Bearer second-token"))), Ok(()));
        std::fs::write(f.path(), "# emptied by mistake\n").unwrap();
        assert!(auth.reload_if_changed().is_err());
        assert_eq!(
            auth.check(&headers(Some("Bearer first"))),
            Ok(()),
            "old tokens kept"
        );
        std::fs::write(f.path(), "third\n").unwrap();
        assert!(auth.reload_if_changed().unwrap());
        assert_eq!(
            auth.check(&headers(Some("Bearer first"))),
            Err(AuthError::Invalid)
        );
        assert_eq!(auth.check(&headers(Some("Bearer third"))), Ok(()));
    }

    #[test]
    fn a_credential_is_no_longer_accepted_once_its_token_is_rotated_out() {
        let f = file("old-token\nnew-token\n");
        let auth = Auth::load(Some(f.path()), Some(&Secret::new("inline-token")))
            .unwrap()
            .unwrap();
        let old = auth
            .authenticate(&headers(Some("Bearer old-token")))
            .unwrap();
        let new = auth
            .authenticate(&headers(Some("Bearer new-token")))
            .unwrap();
        let inline = auth
            .authenticate(&headers(Some("Bearer inline-token")))
            .unwrap();
        assert!(old.still_accepted() && new.still_accepted() && inline.still_accepted());
        assert!(!format!("{old:?}").contains("old-token"));
        std::fs::write(f.path(), "new-token\n").unwrap();
        assert!(auth.reload_if_changed().unwrap());
        assert!(!old.still_accepted(), "rotated out");
        assert!(new.still_accepted() && inline.still_accepted());
        // A rotation caught half-written keeps the tokens read before, credentials too.
        std::fs::write(f.path(), "# emptied by mistake\n").unwrap();
        assert!(auth.reload_if_changed().is_err());
        assert!(new.still_accepted());
    }

    #[test]
    fn the_inline_token_and_the_file_both_count() {
        let f = file("from-file\n");
        let auth = Auth::load(Some(f.path()), Some(&Secret::new("from-env")))
            .unwrap()
            .unwrap();
        assert_eq!(auth.check(&headers(Some("Bearer from-file"))), Ok(()));
        assert_eq!(auth.check(&headers(Some("Bearer from-env"))), Ok(()));
    }
}
