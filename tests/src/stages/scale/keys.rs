//! The keyspace: keys, their tags and Cluster slots, uniform and Zipf draws, each primary's share.

use super::*;

/// The Cluster slot of a hash tag (CRC16/XMODEM modulo 16384), as Redis computes it.
pub(crate) fn slot(tag: &str) -> u16 {
    crc16::State::<crc16::XMODEM>::calculate(tag.as_bytes()) % 16384
}

/// The subject value of key `i` for the sidecar stages (`id`), and its bucket's hash tag.
pub(crate) fn key_id(i: usize) -> String {
    format!("k{i}")
}

/// The client address of key `i` for the Envoy stages (sent as `X-Forwarded-For`).
pub(crate) fn key_ip(i: usize) -> String {
    format!("10.{}.{}.{}", (i >> 16) & 255, (i >> 8) & 255, i & 255)
}

/// The hash tag of a bucket, as the sidecar names it (`rl:{<domain>|rule=<rule>|<dim>=<v>}`;
/// the values used here need no escaping).
pub(crate) fn tag(rule: &str, dim: Option<(&str, &str)>) -> String {
    match dim {
        Some((d, v)) => format!("ratelimit|rule={rule}|{d}={v}"),
        None => format!("ratelimit|rule={rule}"),
    }
}

#[derive(Clone, Copy, PartialEq, Debug)]
pub(crate) enum Dist {
    Uniform,
    Zipf,
}

/// The keyspace: `n` keys, their slots for both paths, and the Zipf weights (rank `i + 1` is
/// key `i`).
pub(crate) struct Keyspace {
    pub(crate) n: usize,
    pub(crate) s: f64,
    pub(crate) zipf_cdf: Vec<f64>,
    pub(crate) zipf_weights: Vec<f64>,
    pub(crate) slot_id: Vec<u16>,
    pub(crate) slot_ip: Vec<u16>,
}

impl Keyspace {
    pub(crate) fn new(n: usize, s: f64) -> Keyspace {
        let raw: Vec<f64> = (1..=n).map(|k| (k as f64).powf(-s)).collect();
        let h: f64 = raw.iter().sum();
        let zipf_weights: Vec<f64> = raw.iter().map(|w| w / h).collect();
        let mut acc = 0.0;
        let zipf_cdf = zipf_weights
            .iter()
            .map(|w| {
                acc += w;
                acc
            })
            .collect();
        Keyspace {
            n,
            s,
            zipf_cdf,
            zipf_weights,
            slot_id: (0..n)
                .map(|i| slot(&tag("scale", Some(("id", &key_id(i))))))
                .collect(),
            slot_ip: (0..n)
                .map(|i| slot(&tag("scale-ip", Some(("ip", &key_ip(i))))))
                .collect(),
        }
    }

    /// A key drawn from `dist` with the random bits `r`.
    pub(crate) fn pick(&self, dist: Dist, r: u64) -> usize {
        match dist {
            Dist::Uniform => (r % self.n as u64) as usize,
            Dist::Zipf => {
                let u = (r >> 11) as f64 / (1u64 << 53) as f64;
                self.zipf_cdf.partition_point(|c| *c < u).min(self.n - 1)
            }
        }
    }

    pub(crate) fn weights(&self, dist: Dist) -> Vec<f64> {
        match dist {
            Dist::Uniform => vec![1.0 / self.n as f64; self.n],
            Dist::Zipf => self.zipf_weights.clone(),
        }
    }

    pub(crate) fn name(&self, dist: Dist) -> String {
        match dist {
            Dist::Uniform => format!("uniform over {} keys", self.n),
            Dist::Zipf => format!("Zipf s={} over {} keys", self.s, self.n),
        }
    }
}

/// The share of decisions on each of `p` primaries holding even slot ranges, for key weights
/// `weights` whose slots are `slots`.
pub(crate) fn shard_shares(weights: &[f64], slots: &[u16], p: usize) -> Vec<f64> {
    let mut by_slot = vec![0.0; 16384];
    for (w, s) in weights.iter().zip(slots) {
        by_slot[*s as usize] += w;
    }
    shares_from_slots(&by_slot, p)
}

pub(crate) fn shares_from_slots(by_slot: &[f64], p: usize) -> Vec<f64> {
    even_slot_ranges(p)
        .into_iter()
        .map(|(a, b)| by_slot[a as usize..=b as usize].iter().sum())
        .collect()
}

pub(crate) fn node_of_slot(p: usize) -> Vec<u8> {
    let mut owner = vec![0u8; 16384];
    for (i, (a, b)) in even_slot_ranges(p).into_iter().enumerate() {
        for s in a..=b {
            owner[s as usize] = i as u8;
        }
    }
    owner
}

// ---------------------------------------------------------------------------------------------
// Processes of this program's own: the sidecar with the scale policy, on any address, in any
// namespace.
