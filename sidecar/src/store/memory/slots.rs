//! Concurrency slots on the memory store, as `lua/slots.lua`.

use super::*;

/// Whether `slot`'s set is within `unsure_ms` of the store's epoch (`--store-reset empty`),
/// when the requests still running that held slots before a loss are not all known again.
pub(super) fn unsure(epoch: Option<f64>, now: f64, slot: &Slot) -> bool {
    let window_ms = slot.unsure_ms.max(slot.ttl_ms);
    epoch.is_some_and(|e| now < e + window_ms as f64 * 1000.0)
}

/// Concurrency slots, as `lua/slots.lua`: the same passes in the same order.
impl MemoryStore {
    /// Takes one request's slots, all or none, at the store's clock.
    pub fn take_slots_now(&self, slots: &[Slot]) -> SlotsTaken {
        let now = self.now_us.load(Ordering::SeqCst) as f64;
        let mut inner = self.inner.lock().expect("not poisoned");
        let epoch = self.epoch(&mut inner, now);
        let mut pending: HashMap<&str, usize> = HashMap::new();
        for (i, slot) in slots.iter().enumerate() {
            let set = inner.slot_sets.entry(slot.key.clone()).or_default();
            set.retain(|_, expiry| *expiry > now);
            if !set.contains_key(&slot.id) {
                let p = pending.entry(&*slot.key).or_default();
                if set.len() + *p >= slot.limit as usize || unsure(epoch, now, slot) {
                    inner.slot_sets.retain(|_, set| !set.is_empty());
                    return SlotsTaken::Full { index: i };
                }
                *p += 1;
            }
        }
        for slot in slots {
            let set = inner.slot_sets.entry(slot.key.clone()).or_default();
            set.insert(slot.id.clone(), now + slot.ttl_ms as f64 * 1000.0);
        }
        SlotsTaken::Taken
    }

    /// Renews or releases slots at the store's clock: per slot, whether it was held.
    pub fn update_slots_now(&self, update: SlotUpdate, slots: &[Slot]) -> Vec<bool> {
        let now = self.now_us.load(Ordering::SeqCst) as f64;
        let mut inner = self.inner.lock().expect("not poisoned");
        let epoch = self.epoch(&mut inner, now);
        let held = slots
            .iter()
            .map(|slot| {
                let set = inner.slot_sets.entry(slot.key.clone()).or_default();
                let alive = set.get(&slot.id).is_some_and(|expiry| *expiry > now);
                match update {
                    SlotUpdate::Release => {
                        set.remove(&slot.id);
                        alive
                    }
                    // Held, or maybe lost with the store's state: held again.
                    SlotUpdate::Renew if alive || unsure(epoch, now, slot) => {
                        set.insert(slot.id.clone(), now + slot.ttl_ms as f64 * 1000.0);
                        true
                    }
                    SlotUpdate::Renew => {
                        set.remove(&slot.id);
                        false
                    }
                }
            })
            .collect();
        inner.slot_sets.retain(|_, set| !set.is_empty());
        held
    }

    /// The slots a set holds now (unexpired), sorted by id.
    pub fn held_slots(&self, key: &str) -> Vec<String> {
        let now = self.now_us.load(Ordering::SeqCst) as f64;
        let inner = self.inner.lock().expect("not poisoned");
        let mut ids: Vec<String> = inner
            .slot_sets
            .get(key)
            .map(|set| {
                set.iter()
                    .filter(|(_, expiry)| **expiry > now)
                    .map(|(id, _)| id.to_string())
                    .collect()
            })
            .unwrap_or_default();
        ids.sort();
        ids
    }
}
