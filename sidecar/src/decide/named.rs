//! The rules gateways named recently: for each (domain, rule) a decision of the wasm filter
//! resolved, when it was last named and the entries it was named with. A policy reload that no
//! longer resolves one named within [`RECENT`] is warned about, naming the rule, and counted
//! (`ratelimit_policy_dropped_rules_total`): the gateways still naming it now get `unknown_rule`
//! for that decision (its rule's `on_error`).
//!
//! Bounded: at most [`MAX_NAMED`] entries (rules of the policy, and dropped ones until they are
//! [`RECENT`] old); a call notes its rules under one lock, and refreshes an entry at most once per
//! [`REFRESH`].

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::Entries;
use crate::metrics::Metrics;
use crate::policy::{Policy, Resolution};

/// How recently a rule must have been named for its removal to be warned about.
pub const RECENT: Duration = Duration::from_secs(600);

/// The most (domain, rule) pairs kept.
pub const MAX_NAMED: usize = 4096;

/// An entry is refreshed at most this often (a call that names it sooner only reads it).
const REFRESH: Duration = Duration::from_secs(1);

/// The rules gateways named recently.
#[derive(Debug, Default)]
pub struct RecentlyNamed {
    /// domain -> rule -> when and how it was last named (looked up by `&str`: a call that names
    /// known rules allocates nothing).
    named: Mutex<HashMap<String, HashMap<String, Named>>>,
}

#[derive(Debug, Clone)]
struct Named {
    at: Instant,
    /// The entries of a decision that named it (`rule=<name>`, then the subject), resolved again
    /// against a new policy.
    entries: Entries,
}

impl RecentlyNamed {
    /// Notes that decisions of one call in `domain` named these rules (each with the entries of
    /// one of its decisions), at `now`.
    pub fn note<'a>(
        &self,
        domain: &str,
        rules: impl IntoIterator<Item = (&'a str, &'a Entries)>,
        now: Instant,
    ) {
        let Ok(mut named) = self.named.lock() else {
            return;
        };
        for (rule, entries) in rules {
            if let Some(n) = named.get_mut(domain).and_then(|m| m.get_mut(rule)) {
                if now.saturating_duration_since(n.at) >= REFRESH {
                    n.at = now;
                    n.entries.clone_from(entries);
                }
                continue;
            }
            if named.values().map(HashMap::len).sum::<usize>() >= MAX_NAMED {
                forget_old(&mut named, now);
                if named.values().map(HashMap::len).sum::<usize>() >= MAX_NAMED {
                    continue;
                }
            }
            named.entry(domain.to_string()).or_default().insert(
                rule.to_string(),
                Named {
                    at: now,
                    entries: entries.clone(),
                },
            );
        }
    }

    /// The rules named within [`RECENT`] of `now` that `policy` no longer resolves, as
    /// `<domain>/<rule>`, each warned about and counted once (then forgotten); entries older than
    /// [`RECENT`] are forgotten too.
    pub fn dropped_by(&self, policy: &Policy, metrics: &Metrics, now: Instant) -> Vec<String> {
        let Ok(mut named) = self.named.lock() else {
            return Vec::new();
        };
        forget_old(&mut named, now);
        let mut dropped = Vec::new();
        let all = named
            .iter()
            .flat_map(|(domain, m)| m.iter().map(move |(rule, n)| (domain, rule, n)));
        for (domain, rule, n) in all {
            let entries: Vec<(&str, Option<&str>)> = n
                .entries
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_deref()))
                .collect();
            if matches!(policy.resolve(domain, &entries), Resolution::Limit(_)) {
                continue;
            }
            tracing::warn!(
                %domain,
                %rule,
                last_named_s_ago = now.saturating_duration_since(n.at).as_secs(),
                "the reloaded policy has no rule {rule:?} in domain {domain:?}, which gateways \
                 named in the last {} minutes: their decisions of it now answer unknown_rule \
                 (the rule's on_error applies to that decision)",
                RECENT.as_secs() / 60
            );
            let name = format!("{domain}/{rule}");
            metrics.policy_dropped_rule(name.clone());
            dropped.push((domain.clone(), rule.clone()));
        }
        // Warned once: an unknown rule is not noted again, so it stays forgotten.
        for (domain, rule) in &dropped {
            if let Some(m) = named.get_mut(domain) {
                m.remove(rule);
            }
        }
        let mut dropped: Vec<String> = dropped
            .into_iter()
            .map(|(d, r)| format!("{d}/{r}"))
            .collect();
        dropped.sort();
        dropped
    }
}

/// Forgets what was named longer than [`RECENT`] ago.
fn forget_old(named: &mut HashMap<String, HashMap<String, Named>>, now: Instant) {
    for m in named.values_mut() {
        m.retain(|_, n| now.saturating_duration_since(n.at) < RECENT);
    }
    named.retain(|_, m| !m.is_empty());
}
