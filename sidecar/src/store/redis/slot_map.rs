//! Which Cluster primary serves which slots (`CLUSTER SLOTS`), read again every few seconds and
//! after a MOVED.

use super::*;

/// Slot ranges and the address of the primary serving each, sorted by start.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct SlotMap {
    pub(super) ranges: Vec<(u16, u16, Arc<str>)>,
}

impl SlotMap {
    /// Each primary's marker tag: `n<k>` for the first `k` whose slot the primary serves.
    pub fn marker_tags(&self) -> HashMap<Arc<str>, String> {
        let mut nodes: Vec<&Arc<str>> = self.ranges.iter().map(|(_, _, n)| n).collect();
        nodes.sort();
        nodes.dedup();
        let mut tags = HashMap::with_capacity(nodes.len());
        // Every slot is reached within a few hundred thousand tags (CRC16 spreads them evenly).
        for k in 0..2_000_000u32 {
            if tags.len() == nodes.len() {
                break;
            }
            let tag = format!("n{k}");
            if let Some(node) = self.node(cluster_slot(format!("{{{tag}}}").as_bytes())) {
                tags.entry(node.clone()).or_insert(tag);
            }
        }
        tags
    }

    pub(super) fn node(&self, slot: u16) -> Option<&Arc<str>> {
        let i = self.ranges.partition_point(|(start, _, _)| *start <= slot);
        let (start, end, addr) = self.ranges.get(i.checked_sub(1)?)?;
        (*start <= slot && slot <= *end).then_some(addr)
    }

    /// Parses a `CLUSTER SLOTS` reply: `[[start, end, [ip, port, id...], replicas...], ...]`.
    pub fn from_cluster_slots(v: &Value) -> Option<SlotMap> {
        let Value::Array(entries) = v else {
            return None;
        };
        let mut ranges = Vec::with_capacity(entries.len());
        for e in entries {
            let Value::Array(parts) = e else {
                return None;
            };
            let (Some(Value::Int(start)), Some(Value::Int(end)), Some(Value::Array(primary))) =
                (parts.first(), parts.get(1), parts.get(2))
            else {
                return None;
            };
            let host = match primary.first()? {
                Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
                Value::SimpleString(s) => s.clone(),
                _ => return None,
            };
            let Some(Value::Int(port)) = primary.get(1) else {
                return None;
            };
            ranges.push((
                u16::try_from(*start).ok()?,
                u16::try_from(*end).ok()?,
                Arc::from(format!("{host}:{port}")),
            ));
        }
        ranges.sort_by_key(|r| r.0);
        Some(SlotMap { ranges })
    }
}

impl RedisStore {
    /// Reads `CLUSTER SLOTS` and keeps the map when it parses.
    pub(super) async fn load_slot_map(&self) {
        let mut cmd = redis::cmd("CLUSTER");
        cmd.arg("SLOTS");
        match self.bounded(self.query(cmd)).await {
            Ok(v) => match SlotMap::from_cluster_slots(&v) {
                Some(map) if !map.ranges.is_empty() => {
                    if **self.inner.slots.load() != map {
                        tracing::info!(ranges = map.ranges.len(), "cluster slot map loaded");
                        let prefix = &self.inner.options.key_prefix;
                        let markers = map
                            .marker_tags()
                            .into_iter()
                            .map(|(node, tag)| (node, epoch_marker(prefix, Some(&tag))))
                            .collect();
                        self.inner.slots.store(Arc::new(map));
                        self.inner.markers.store(Arc::new(markers));
                    }
                }
                _ => tracing::warn!("unexpected CLUSTER SLOTS reply"),
            },
            Err(e) => tracing::debug!("CLUSTER SLOTS: {e}"),
        }
    }
}
