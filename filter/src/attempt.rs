//! The attempt id of a callout: what lets the sidecar recognise a repeat of the same call and not
//! charge it twice, and what names the record a cross-node refund reads.
//!
//! It is `<vm nonce>-<counter>`: a random 64-bit nonce drawn when the VM starts, and a counter of
//! this VM's callouts. Two callouts never share one, whatever the clients send (no header takes
//! part in it) and whatever the clock does (no time takes part in it either): within a VM the
//! counter never repeats, and two VMs (two workers, two Envoys, a restart) draw different nonces
//! (a collision needs two equal 64-bit random draws).

/// The attempt id of the `counter`-th callout of the VM whose nonce is `vm_nonce`.
pub fn attempt_id(vm_nonce: u64, counter: u64) -> String {
    format!("{vm_nonce:016x}-{counter}")
}

/// The attempt ids of one VM, in order.
#[derive(Debug, Clone)]
pub struct Attempts {
    nonce: u64,
    next: u64,
}

impl Attempts {
    pub fn new(nonce: u64) -> Self {
        Attempts { nonce, next: 0 }
    }

    /// A new id, never returned before by this VM.
    pub fn next_id(&mut self) -> String {
        self.next = self.next.wrapping_add(1);
        attempt_id(self.nonce, self.next)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn a_vm_never_repeats_an_id() {
        let mut a = Attempts::new(0xabc);
        let ids: HashSet<String> = (0..10_000).map(|_| a.next_id()).collect();
        assert_eq!(ids.len(), 10_000);
        assert!(ids.contains("0000000000000abc-1"));
    }

    #[test]
    fn two_vms_with_different_nonces_never_share_an_id() {
        // The same counter on two VMs (e.g. two workers that received the same x-request-id in
        // the same nanosecond): the nonces tell them apart.
        let mut a = Attempts::new(1);
        let mut b = Attempts::new(2);
        for _ in 0..100 {
            assert_ne!(a.next_id(), b.next_id());
        }
    }

    #[test]
    fn ids_are_short_printable_ascii() {
        let id = attempt_id(u64::MAX, u64::MAX);
        assert!(id.len() <= ratelimit_wire::MAX_NAME_BYTES);
        assert!(id.bytes().all(|b| b.is_ascii_graphic()));
    }
}
