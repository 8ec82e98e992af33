//! What the store tells `/readyz`: Redis answers, the scripts are loaded (loaded where one is
//! missing), and `maxmemory-policy` cannot evict buckets.

use super::*;

impl RedisStore {
    /// Checks Redis, loads the scripts where one is missing, reads `maxmemory-policy`.
    pub async fn check_readiness(&self) -> Readiness {
        let mut r = Readiness::default();
        let mut exists = redis::cmd("SCRIPT");
        exists.arg("EXISTS");
        for script in Script::ALL {
            exists.arg(script.sha1());
        }
        match self.bounded(self.query_all_primaries(exists, None)).await {
            Ok(v) => {
                r.redis_ok = true;
                let flags = integers(&v);
                r.script_loaded = !flags.is_empty() && flags.iter().all(|f| *f == 1);
            }
            Err(e) => {
                let refused = match e {
                    StoreError::Timeout { .. } => {
                        self.inner.connection.refused(self.timeout()).await
                    }
                    _ => None,
                };
                r.error = Some(
                    refused.map_or_else(|| e.to_string(), |r| format!("redis unavailable: {r}")),
                );
                return r;
            }
        }
        // Every node's epoch is fenced first (`lua/fence.lua`: made when missing, made anew on a
        // new server), so no script is loaded into a node before its epoch says what it holds;
        // ready also means the markers exist (the watch still sees one made anew as a loss).
        let markers = self.epoch_markers();
        let mut fenced = !markers.is_empty() || self.inner.options.store_reset == StoreReset::Full;
        for (node, marker) in markers {
            if let Err(e) = self.fence(&node).await {
                r.error.get_or_insert(format!("epoch marker {marker}: {e}"));
                fenced = false;
            }
        }
        if !r.script_loaded && !fenced {
            r.error
                .get_or_insert("the scripts wait for every node's epoch (lua/fence.lua)".into());
        }
        if !r.script_loaded && fenced {
            for script in Script::ALL {
                let mut load = redis::cmd("SCRIPT");
                load.arg("LOAD").arg(script.text());
                let all = Some(ResponsePolicy::AllSucceeded);
                if let Err(e) = self.bounded(self.query_all_primaries(load, all)).await {
                    r.error = Some(format!("SCRIPT LOAD: {e}"));
                    break;
                }
                self.inner.metrics.script_loads.inc();
            }
            r.script_loaded = r.error.is_none();
        }
        let mut config = redis::cmd("CONFIG");
        config.arg("GET").arg("maxmemory-policy");
        match self.bounded(self.query_all_primaries(config, None)).await {
            Ok(v) => {
                let mut policies = Vec::new();
                let mut refused = None;
                maxmemory_policies(&v, &mut policies, &mut refused);
                r.maxmemory_policy = policies;
                r.warning = eviction_warning(&r.maxmemory_policy);
                // 0 only when every node answered noeviction: a refused CONFIG GET leaves the
                // gauge as it was, unless another node shows it can evict.
                let evicting = r.warning.is_some();
                if evicting || (refused.is_none() && !r.maxmemory_policy.is_empty()) {
                    self.inner.metrics.eviction_policy(evicting);
                }
                if let Some(e) = refused {
                    r.warning.get_or_insert(format!(
                        "could not check maxmemory-policy (CONFIG GET refused: {e}); make sure it is noeviction"
                    ));
                }
            }
            Err(e) => {
                r.warning = Some(format!(
                    "could not check maxmemory-policy ({e}); make sure it is noeviction"
                ))
            }
        }
        r
    }
}

/// The `maxmemory-policy` values in a `CONFIG GET` reply from one or many nodes.
pub(super) fn maxmemory_policies(v: &Value, out: &mut Vec<String>, refused: &mut Option<String>) {
    let text = |v: &Value| match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    };
    match v {
        Value::Array(items) if items.len() == 2 && text(&items[0]).is_some() => {
            if let Some(policy) = text(&items[1]) {
                out.push(policy);
            }
        }
        Value::Array(items) if items.is_empty() => {
            *refused = Some("empty reply".into());
        }
        Value::Map(pairs) => {
            for (k, v) in pairs {
                if text(k).as_deref() == Some("maxmemory-policy") {
                    if let Some(policy) = text(v) {
                        out.push(policy);
                    }
                } else {
                    maxmemory_policies(v, out, refused);
                }
            }
        }
        Value::ServerError(e) => *refused = Some(format!("{e:?}")),
        _ => {}
    }
}

/// The warning for a `maxmemory-policy` that can evict buckets, if it can.
fn eviction_warning(policies: &[String]) -> Option<String> {
    let evicting: Vec<&str> = policies
        .iter()
        .map(String::as_str)
        .filter(|p| *p != "noeviction")
        .collect();
    if evicting.is_empty() {
        return None;
    }
    Some(format!(
        "maxmemory-policy is {} (not noeviction): Redis may evict buckets under memory pressure, \
         which hands out budget early; set maxmemory-policy noeviction",
        evicting.join(",")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policies_that_evict_are_warned_about() {
        assert_eq!(eviction_warning(&["noeviction".into()]), None);
        let w = eviction_warning(&["noeviction".into(), "allkeys-lru".into()]).unwrap();
        assert!(w.contains("allkeys-lru"), "{w}");
        assert!(eviction_warning(&["volatile-ttl".into()]).is_some());
    }
}
