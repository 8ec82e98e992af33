//! Certificates the tests make for themselves (rcgen): a CA; a server certificate for 127.0.0.1,
//! ::1 and localhost signed by it (good for client authentication too, since redis-server presents
//! its certificate on replication, Sentinel and cluster-bus links); a client certificate signed
//! by it; and an impostor, a client certificate from a CA nobody trusts. PEM files in a temp dir
//! that lives as long as the last clone of the [`TestPki`].

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

/// A CA and the certificates it signed, as PEM files.
#[derive(Clone)]
pub struct TestPki {
    dir: Arc<tempfile::TempDir>,
    /// The CA certificate (what servers and clients trust).
    pub ca: PathBuf,
    /// A certificate for `127.0.0.1`, `::1` and `localhost`, usable by servers and clients.
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    /// A client certificate (`CN=ratelimit-client`).
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
    /// A client certificate from another CA, which nothing trusts.
    pub impostor_cert: PathBuf,
    pub impostor_key: PathBuf,
}

fn ca(name: &str) -> (rcgen::Certificate, Issuer<'static, KeyPair>) {
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
    ];
    let key = KeyPair::generate().expect("CA key");
    let cert = params.self_signed(&key).expect("self-sign the CA");
    (cert, Issuer::new(params, key))
}

fn leaf(
    issuer: &Issuer<'static, KeyPair>,
    common_name: &str,
    names: &[&str],
    usages: &[ExtendedKeyUsagePurpose],
) -> (String, String) {
    let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
    let mut params = CertificateParams::new(names).expect("leaf params");
    params
        .distinguished_name
        .push(DnType::CommonName, common_name);
    params.use_authority_key_identifier_extension = true;
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = usages.to_vec();
    let key = KeyPair::generate().expect("leaf key");
    let cert = params.signed_by(&key, issuer).expect("sign the leaf");
    (cert.pem(), key.serialize_pem())
}

impl TestPki {
    /// Makes a fresh CA and its certificates.
    pub fn generate() -> TestPki {
        let dir = tempfile::tempdir().expect("temp dir");
        let write = |name: &str, pem: &str| {
            let p = dir.path().join(name);
            std::fs::write(&p, pem).expect("write PEM");
            p
        };
        let (ca_cert, issuer) = ca("ratelimit test CA");
        let (server_cert, server_key) = leaf(
            &issuer,
            "localhost",
            &["localhost", "127.0.0.1", "::1"],
            &[
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ],
        );
        let (client_cert, client_key) = leaf(
            &issuer,
            "ratelimit-client",
            &["ratelimit-client"],
            &[ExtendedKeyUsagePurpose::ClientAuth],
        );
        let (_, other_issuer) = ca("an untrusted CA");
        let (impostor_cert, impostor_key) = leaf(
            &other_issuer,
            "ratelimit-client",
            &["ratelimit-client"],
            &[ExtendedKeyUsagePurpose::ClientAuth],
        );
        TestPki {
            ca: write("ca.pem", &ca_cert.pem()),
            server_cert: write("server.pem", &server_cert),
            server_key: write("server-key.pem", &server_key),
            client_cert: write("client.pem", &client_cert),
            client_key: write("client-key.pem", &client_key),
            impostor_cert: write("impostor.pem", &impostor_cert),
            impostor_key: write("impostor-key.pem", &impostor_key),
            dir: Arc::new(dir),
        }
    }

    /// The directory of the files.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// `--tls-cert-file`, `--tls-key-file`, `--tls-ca-cert-file` for redis-server.
    pub fn redis_server_args(&self) -> Vec<String> {
        [
            ("--tls-cert-file", &self.server_cert),
            ("--tls-key-file", &self.server_key),
            ("--tls-ca-cert-file", &self.ca),
        ]
        .iter()
        .flat_map(|(flag, path)| [flag.to_string(), path.display().to_string()])
        .collect()
    }

    /// `--tls --cacert --cert --key` for redis-cli (with the client certificate).
    pub fn redis_cli_args(&self) -> Vec<String> {
        vec![
            "--tls".into(),
            "--cacert".into(),
            self.ca.display().to_string(),
            "--cert".into(),
            self.client_cert.display().to_string(),
            "--key".into(),
            self.client_key.display().to_string(),
        ]
    }

    /// The sidecar's flags for TLS to Redis: the CA and the client certificate.
    pub fn sidecar_redis_args(&self) -> Vec<String> {
        vec![
            "--redis-ca-file".into(),
            self.ca.display().to_string(),
            "--redis-client-cert".into(),
            self.client_cert.display().to_string(),
            "--redis-client-key".into(),
            self.client_key.display().to_string(),
        ]
    }

    /// The sidecar's flags to serve TLS with the server certificate, requiring client
    /// certificates signed by the CA.
    pub fn sidecar_mtls_args(&self) -> Vec<String> {
        vec![
            "--tls-cert".into(),
            self.server_cert.display().to_string(),
            "--tls-key".into(),
            self.server_key.display().to_string(),
            "--tls-client-ca".into(),
            self.ca.display().to_string(),
        ]
    }

    /// redis-rs's TLS material: trust the CA, present the client certificate.
    pub fn redis_certificates(&self) -> redis::TlsCertificates {
        redis::TlsCertificates {
            client_tls: Some(redis::ClientTlsConfig {
                client_cert: std::fs::read(&self.client_cert).expect("client cert"),
                client_key: std::fs::read(&self.client_key).expect("client key"),
            }),
            root_cert: Some(std::fs::read(&self.ca).expect("CA")),
        }
    }

    /// The CA as reqwest's root certificate.
    pub fn reqwest_root(&self) -> reqwest::Certificate {
        reqwest::Certificate::from_pem(&std::fs::read(&self.ca).expect("CA")).expect("CA PEM")
    }

    /// A blocking HTTPS client that trusts only the CA, presenting `identity` (certificate,
    /// key) when given. HTTP/2 or HTTP/1.1 as ALPN settles.
    pub fn https_client(&self, identity: Option<(&Path, &Path)>) -> reqwest::blocking::Client {
        self.https_client_builder(identity)
            .build()
            .expect("https client")
    }

    /// [`TestPki::https_client`]'s builder, for more settings.
    pub fn https_client_builder(
        &self,
        identity: Option<(&Path, &Path)>,
    ) -> reqwest::blocking::ClientBuilder {
        let mut b = reqwest::blocking::Client::builder()
            .tls_built_in_root_certs(false)
            .add_root_certificate(self.reqwest_root())
            .timeout(std::time::Duration::from_secs(10))
            .no_proxy();
        if let Some((cert, key)) = identity {
            b = b.identity(TestPki::reqwest_identity(cert, key));
        }
        b
    }

    /// The client certificate of [`TestPki::client_cert`] as `(cert, key)`.
    pub fn client_identity(&self) -> Option<(&Path, &Path)> {
        Some((&self.client_cert, &self.client_key))
    }

    /// A certificate and key as a reqwest client identity.
    pub fn reqwest_identity(cert: &Path, key: &Path) -> reqwest::Identity {
        let mut pem = std::fs::read(cert).expect("cert");
        pem.extend(std::fs::read(key).expect("key"));
        reqwest::Identity::from_pem(&pem).expect("identity PEM")
    }
}
