//! A Redis URL as it may be shown: every credential replaced.

/// A Redis URL as it may be shown (logs, answers, `/readyz`, errors): every credential replaced
/// by `***`: the userinfo's password, and the query's `pass`, `password`, `user` and `username`
/// (redis-rs takes a `unix://` or `redis+unix://` URL's user and password from `user=` and
/// `pass=`). A URL that does not parse keeps nothing of what stands before an `@` nor its query.
pub fn redacted_url(url: &str) -> String {
    const SECRET: &str = "***";
    let credential = |k: &str| {
        ["pass", "password", "user", "username"]
            .iter()
            .any(|c| k.eq_ignore_ascii_case(c))
    };
    match redis::parse_redis_url(url) {
        Some(mut u) => {
            if u.password().is_some() {
                let _ = u.set_password(Some(SECRET));
            }
            let has_credential = u.query_pairs().any(|(k, _)| credential(&k));
            if has_credential {
                let pairs: Vec<(String, String)> = u
                    .query_pairs()
                    .map(|(k, v)| {
                        let v = if credential(&k) {
                            SECRET.into()
                        } else {
                            v.into_owned()
                        };
                        (k.into_owned(), v)
                    })
                    .collect();
                u.query_pairs_mut().clear().extend_pairs(pairs);
            }
            // `***` percent-encoded in a query reads `%2A%2A%2A`: show it as written.
            u.to_string().replace("%2A%2A%2A", SECRET)
        }
        None => {
            let (url, query) = match url.split_once('?') {
                Some((before, _)) => (before, "?***"),
                None => (url, ""),
            };
            match (url.split_once("://"), url.rfind('@')) {
                (Some((scheme, _)), Some(at)) => {
                    format!("{scheme}://***@{}{query}", &url[at + 1..])
                }
                (None, Some(at)) => format!("***@{}{query}", &url[at + 1..]),
                _ => format!("{url}{query}"),
            }
        }
    }
}

/// Several URLs, redacted and comma separated, as a flag takes them.
pub fn redacted_urls(urls: &[String]) -> String {
    urls.iter()
        .map(|u| redacted_url(u))
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_shown_without_their_password() {
        assert_eq!(
            redacted_url("redis://:hunter2@127.0.0.1:6379"),
            "redis://:***@127.0.0.1:6379"
        );
        assert_eq!(
            redacted_url("rediss://app:hunter2@redis.example:6380/0"),
            "rediss://app:***@redis.example:6380/0"
        );
        assert_eq!(
            redacted_url("redis://127.0.0.1:6379"),
            "redis://127.0.0.1:6379"
        );
        assert_eq!(redacted_url("redis://user@h:1"), "redis://user@h:1");
        let odd = redacted_url("http://:hunter2@127.0.0.1:6379");
        assert!(!odd.contains("hunter2"), "{odd}");
        let odd = redacted_url("redis://:hun@ter2@[::1");
        assert!(!odd.contains("hun") && !odd.contains("ter2"), "{odd}");
        assert_eq!(
            redacted_urls(&["redis://:a@h:1".into(), "redis://:b@h:2".into()]),
            "redis://:***@h:1,redis://:***@h:2"
        );
    }

    #[test]
    fn every_credential_form_of_a_url_is_redacted() {
        // Unix sockets take their user and password from the query (redis-rs: `user=`, `pass=`).
        for (url, shown) in [
            (
                "redis+unix:///run/redis.sock?pass=s3cret-a&db=2",
                "redis+unix:///run/redis.sock?pass=***&db=2",
            ),
            (
                "unix:///run/redis.sock?user=app&pass=s3cret-a&protocol=bogus",
                "unix:///run/redis.sock?user=***&pass=***&protocol=bogus",
            ),
            (
                "redis+unix:///r.sock?PASSWORD=s3cret-a&username=app",
                "redis+unix:///r.sock?PASSWORD=***&username=***",
            ),
            (
                "redis://:s3cret-a@h:1/0?pass=s3cret-a",
                "redis://:***@h:1/0?pass=***",
            ),
            ("redis+unix:///r.sock?db=1", "redis+unix:///r.sock?db=1"),
        ] {
            let r = redacted_url(url);
            assert_eq!(r, shown, "{url}");
            assert!(!r.contains("s3cret") && !r.contains("app"), "{r}");
        }
        // A URL that does not parse keeps neither its userinfo nor its query.
        let odd = redacted_url("redis+unix://:s3cret-a@[::1?pass=s3cret-a");
        assert!(!odd.contains("s3cret"), "{odd}");
        assert!(odd.ends_with("?***"), "{odd}");
    }
}
