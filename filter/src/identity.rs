//! Who a request is: the [`Subject`] resolved from facts the host gathered from trustworthy
//! sources only (a validated API key, claims `jwt_authn` verified, the address Envoy computed,
//! the route Envoy picked). Anything odd — non-UTF-8, empty, unparsable — is unknown, never an
//! error and never a panic.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};

use crate::config::{Dimension, Identity, MAX_IDENTITY_BYTES};

/// The property holding the downstream address as Envoy computed it (honouring
/// `use_remote_address` / `xff_num_trusted_hops`).
pub const SOURCE_ADDRESS_PROPERTY: [&str; 2] = ["source", "address"];

/// The property holding the name of the route Envoy matched.
pub const ROUTE_NAME_PROPERTY: [&str; 2] = ["xds", "route_name"];

/// The metadata namespace where `jwt_authn` publishes verified payloads.
pub const JWT_AUTHN_NAMESPACE: &str = "envoy.filters.http.jwt_authn";

/// The property path of one verified JWT claim, published by `jwt_authn` with
/// `payload_in_metadata: <provider>`.
pub fn jwt_claim_property<'a>(provider: &'a str, claim: &'a str) -> [&'a str; 5] {
    [
        "metadata",
        "filter_metadata",
        JWT_AUTHN_NAMESPACE,
        provider,
        claim,
    ]
}

/// What the host read for one request; `None` when absent or unreadable.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Facts {
    /// The value of the configured API-key header.
    pub api_key: Option<Vec<u8>>,
    /// The verified user claim.
    pub jwt_user: Option<Vec<u8>>,
    /// The verified tenant claim.
    pub jwt_tenant: Option<Vec<u8>>,
    /// `source.address`.
    pub source_address: Option<Vec<u8>>,
    /// `xds.route_name`.
    pub route_name: Option<Vec<u8>>,
}

/// The known dimensions of one request; `None` is unknown.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Subject {
    pub user: Option<String>,
    pub tenant: Option<String>,
    pub app: Option<String>,
    pub ip: Option<String>,
    pub route: Option<String>,
}

impl Subject {
    /// The value of one dimension, if known.
    pub fn get(&self, dimension: Dimension) -> Option<&str> {
        match dimension {
            Dimension::User => self.user.as_deref(),
            Dimension::Tenant => self.tenant.as_deref(),
            Dimension::App => self.app.as_deref(),
            Dimension::Ip => self.ip.as_deref(),
            Dimension::Route => self.route.as_deref(),
        }
    }
}

/// Resolves the subject from the gathered facts, using only the sources the configuration turns
/// on.
pub fn resolve(identity: &Identity, facts: &Facts) -> Subject {
    Subject {
        app: identity
            .api_key
            .as_ref()
            .and_then(|k| app_for_key(&k.keys, facts.api_key.as_deref()?)),
        user: identity
            .jwt
            .as_ref()
            .and_then(|_| text(facts.jwt_user.as_deref()?)),
        tenant: identity
            .jwt
            .as_ref()
            .and_then(|j| j.tenant_claim.as_ref())
            .and_then(|_| text(facts.jwt_tenant.as_deref()?)),
        ip: if identity.ip {
            facts
                .source_address
                .as_deref()
                .and_then(parse_source_address)
                .map(|ip| ip_key(ip, identity.ipv6_prefix_len))
        } else {
            None
        },
        route: text(facts.route_name.as_deref().unwrap_or_default()),
    }
}

/// The application a key names: its SHA-256 is looked up among the configured hashes, so the
/// configuration never holds a key and an unknown (or empty) key names no one.
pub fn app_for_key(keys: &BTreeMap<String, String>, key: &[u8]) -> Option<String> {
    if key.is_empty() {
        return None;
    }
    keys.get(&sha256_hex(key)).cloned()
}

pub use ratelimit_wire::names::sha256_hex;

/// The IP of `source.address`: `1.2.3.4:5678`, `[::1]:80`, or a bare address. An IPv4-mapped
/// IPv6 address is its IPv4 address (one client, one bucket). Anything else (a pipe path,
/// garbage) is unknown.
pub fn parse_source_address(bytes: &[u8]) -> Option<IpAddr> {
    let s = std::str::from_utf8(bytes).ok()?.trim();
    let ip = s
        .parse::<SocketAddr>()
        .map(|a| a.ip())
        .or_else(|_| s.parse::<IpAddr>())
        .or_else(|_| {
            s.strip_prefix('[')
                .and_then(|x| x.strip_suffix(']'))
                .unwrap_or("")
                .parse::<IpAddr>()
        })
        .ok()?;
    Some(match ip {
        IpAddr::V6(v6) => v6
            .to_ipv4_mapped()
            .map(IpAddr::V4)
            .unwrap_or(IpAddr::V6(v6)),
        v4 => v4,
    })
}

/// The `ip` value of a client: an IPv4 address as is (`10.1.2.3`); an IPv6 address as its
/// network of `ipv6_prefix_len` bits (`2001:db8:1:2::/64`), since one client holds a whole prefix
/// and could otherwise rotate addresses to escape its limit. (An IPv4-mapped IPv6 address is
/// already IPv4 here: see [`parse_source_address`].)
pub fn ip_key(ip: IpAddr, ipv6_prefix_len: u8) -> String {
    match ip {
        IpAddr::V4(v4) => v4.to_string(),
        IpAddr::V6(v6) => {
            let len = ipv6_prefix_len.clamp(1, 128);
            let mask = u128::MAX.checked_shl(128 - u32::from(len)).unwrap_or(0);
            format!("{}/{len}", Ipv6Addr::from(u128::from(v6) & mask))
        }
    }
}

/// A claim or route name as text: non-empty UTF-8 without control characters, at most
/// [`MAX_IDENTITY_BYTES`]; otherwise unknown (a non-string claim comes as non-text bytes).
pub fn text(bytes: &[u8]) -> Option<String> {
    if bytes.is_empty() || bytes.len() > MAX_IDENTITY_BYTES {
        return None;
    }
    let s = std::str::from_utf8(bytes).ok()?;
    if s.chars().any(char::is_control) {
        return None;
    }
    Some(s.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::example;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const ALPHA_HASH: &str = "677509799af78b2efa2f2af71d0f906e0a0c50c048efd3b515625f788e92b99a";

    #[test]
    fn alpha_key_hashes_to_the_configured_digest() {
        assert_eq!(sha256_hex(b"alpha-key"), ALPHA_HASH);
    }

    #[test]
    fn a_known_key_names_its_app_and_unknown_keys_name_no_one() {
        let c = example();
        let keys = &c.identity.api_key.as_ref().unwrap().keys;
        assert_eq!(app_for_key(keys, b"alpha-key").as_deref(), Some("alpha"));
        assert_eq!(app_for_key(keys, b"beta-key"), None);
        assert_eq!(app_for_key(keys, b""), None);
        // Presenting the hash itself as the key does not work either.
        assert_eq!(app_for_key(keys, ALPHA_HASH.as_bytes()), None);
        assert_eq!(app_for_key(keys, &[0xff, 0xfe, 0x00]), None);
    }

    #[test]
    fn source_addresses_with_and_without_ports() {
        let ip = |s: &str| parse_source_address(s.as_bytes()).map(|i| i.to_string());
        assert_eq!(ip("1.2.3.4:5678").as_deref(), Some("1.2.3.4"));
        assert_eq!(ip("1.2.3.4").as_deref(), Some("1.2.3.4"));
        assert_eq!(ip("[::1]:80").as_deref(), Some("::1"));
        assert_eq!(ip("::1").as_deref(), Some("::1"));
        assert_eq!(ip("[2001:db8::1]").as_deref(), Some("2001:db8::1"));
        assert_eq!(
            ip("[2001:0db8:0000::0001]:443").as_deref(),
            Some("2001:db8::1")
        );
        assert_eq!(ip("[::ffff:10.0.0.1]:80").as_deref(), Some("10.0.0.1"));
        assert_eq!(ip("9.9.9.9:0").as_deref(), Some("9.9.9.9"));
    }

    #[test]
    fn ipv6_clients_are_keyed_by_their_prefix_and_ipv4_by_the_address() {
        let key = |s: &str, len: u8| ip_key(parse_source_address(s.as_bytes()).unwrap(), len);
        assert_eq!(key("[2001:db8:1:2:aaaa::1]:443", 64), "2001:db8:1:2::/64");
        // A client rotating addresses within its /64 stays one subject.
        assert_eq!(key("[2001:db8:1:2:ffff:1:2:3]:80", 64), "2001:db8:1:2::/64");
        assert_ne!(key("[2001:db8:1:3::1]:80", 64), "2001:db8:1:2::/64");
        assert_eq!(key("2001:db8:1:2:aaaa::1", 48), "2001:db8:1::/48");
        assert_eq!(key("2001:db8::1", 128), "2001:db8::1/128");
        assert_eq!(key("[::1]:80", 64), "::/64");
        assert_eq!(key("1.2.3.4:80", 64), "1.2.3.4");
        assert_eq!(key("[::ffff:10.0.0.1]:80", 64), "10.0.0.1");
        let facts = Facts {
            source_address: Some(b"[2001:db8:0:1:2:3:4:5]:1234".to_vec()),
            ..Facts::default()
        };
        let s = resolve(&example().identity, &facts);
        assert_eq!(s.ip.as_deref(), Some("2001:db8:0:1::/64"));
    }

    #[test]
    fn garbage_source_addresses_are_unknown() {
        for s in [
            &b""[..],
            b"garbage",
            b"/var/run/envoy.sock",
            b"1.2.3.4:99999",
            b"1.2.3",
            b"[::1",
            &[0xff, 0xfe],
            b"300.1.1.1:80",
        ] {
            assert_eq!(parse_source_address(s), None, "{s:?}");
        }
    }

    #[test]
    fn claims_must_be_plain_text() {
        assert_eq!(text(b"user-1").as_deref(), Some("user-1"));
        assert_eq!(text(b""), None);
        assert_eq!(text(&[0xc3, 0x28]), None);
        assert_eq!(text(b"a\nb"), None);
        assert_eq!(text(&[0u8; 8]), None);
        assert_eq!(text(&vec![b'a'; MAX_IDENTITY_BYTES + 1]), None);
        assert!(text(&vec![b'a'; MAX_IDENTITY_BYTES]).is_some());
    }

    #[test]
    fn resolve_uses_only_configured_sources() {
        let c = example();
        let facts = Facts {
            api_key: Some(b"alpha-key".to_vec()),
            jwt_user: Some(b"u-1".to_vec()),
            jwt_tenant: Some(b"t-1".to_vec()),
            source_address: Some(b"10.1.2.3:4444".to_vec()),
            route_name: Some(b"api".to_vec()),
        };
        let s = resolve(&c.identity, &facts);
        assert_eq!(
            s,
            Subject {
                user: Some("u-1".into()),
                tenant: Some("t-1".into()),
                app: Some("alpha".into()),
                ip: Some("10.1.2.3".into()),
                route: Some("api".into()),
            }
        );
        let none = resolve(&Identity::default(), &facts);
        assert_eq!(
            none,
            Subject {
                route: Some("api".into()),
                ..Subject::default()
            }
        );
    }

    #[test]
    fn resolve_with_nothing_gathered_knows_nothing() {
        let s = resolve(&example().identity, &Facts::default());
        assert_eq!(s, Subject::default());
        let empty_route = Facts {
            route_name: Some(Vec::new()),
            ..Facts::default()
        };
        assert_eq!(resolve(&example().identity, &empty_route).route, None);
    }

    #[test]
    fn jwt_claim_property_path() {
        assert_eq!(
            jwt_claim_property("example", "sub"),
            [
                "metadata",
                "filter_metadata",
                "envoy.filters.http.jwt_authn",
                "example",
                "sub"
            ]
        );
    }
}
