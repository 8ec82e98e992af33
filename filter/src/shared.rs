//! Shared data as proxy-wasm offers it (a key-value store per `vm_id`, shared by every worker VM
//! of one Envoy, with a version per key), and the one compare-and-swap loop every writer uses
//! ([`compare_and_swap`]): the fast paths' table ([`crate::fastpath`]) and the emergency buckets
//! ([`crate::emergency`]).

/// How often a compare-and-swap is retried before the writer gives up: a fast path then leaves
/// the request to the sidecar (or a give-back is lost), an emergency take denies. Never an
/// over-admission.
pub const MAX_CAS_ATTEMPTS: usize = 32;

/// Why shared data refused a write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SharedDataError {
    /// Someone else wrote since our read (from [`compare_and_swap`]: on each of
    /// [`MAX_CAS_ATTEMPTS`] attempts).
    CasMismatch,
    /// Anything else the host said.
    Failed,
}

/// Shared data with compare-and-swap.
pub trait SharedStore {
    /// The value under `key` and its version (`None` when the key is absent).
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>);
    /// Writes `value` if the version is still `cas` (`None`: unconditionally).
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SharedDataError>;
}

/// What a writer makes of the value it read under its key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Write<T> {
    /// Store these bytes if nobody wrote since the read (else read again), then answer `T`.
    Store(Vec<u8>, T),
    /// Store nothing: answer `T` at once.
    Keep(T),
}

/// Reads `key`, lets `change` decide from the bytes read (`None`: absent) what to write, and
/// writes it if the key's version is still the one read; on a mismatch, reads again, up to
/// [`MAX_CAS_ATTEMPTS`] times. `change` may run several times: it must not act outside its
/// answer.
pub fn compare_and_swap<T>(
    store: &dyn SharedStore,
    key: &str,
    mut change: impl FnMut(Option<&[u8]>) -> Write<T>,
) -> Result<T, SharedDataError> {
    for _ in 0..MAX_CAS_ATTEMPTS {
        let (bytes, cas) = store.get(key);
        match change(bytes.as_deref()) {
            Write::Keep(out) => return Ok(out),
            Write::Store(value, out) => match store.set(key, &value, cas) {
                Ok(()) => return Ok(out),
                Err(SharedDataError::CasMismatch) => continue,
                Err(SharedDataError::Failed) => return Err(SharedDataError::Failed),
            },
        }
    }
    Err(SharedDataError::CasMismatch)
}

/// Shared data in memory, for the unit tests of the modules that write it.
#[cfg(test)]
pub(crate) mod fake {
    use std::cell::{Cell, RefCell};
    use std::collections::HashMap;

    use super::{SharedDataError, SharedStore};

    /// Shared data with compare-and-swap, in memory. It can fail the next `conflicts` writes
    /// with a version mismatch, let another worker write a key just before our next write to it
    /// (`interleave`: the key and the value), and counts the writes it was asked for.
    #[derive(Default)]
    pub struct Memory {
        pub data: RefCell<HashMap<String, (Vec<u8>, u32)>>,
        pub conflicts: Cell<usize>,
        pub interleave: RefCell<Option<(String, Vec<u8>)>>,
        pub writes: Cell<usize>,
    }

    impl Memory {
        /// Stores `value` under `key` as another worker would (a new version).
        pub fn put(&self, key: &str, value: &[u8]) {
            let mut data = self.data.borrow_mut();
            let version = data.get(key).map_or(0, |(_, c)| *c) + 1;
            data.insert(key.to_string(), (value.to_vec(), version));
        }
    }

    impl SharedStore for Memory {
        fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
            match self.data.borrow().get(key) {
                Some((v, cas)) => (Some(v.clone()), Some(*cas)),
                None => (None, None),
            }
        }

        fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SharedDataError> {
            self.writes.set(self.writes.get() + 1);
            let interleaved = self
                .interleave
                .borrow_mut()
                .take_if(|(k, _)| k.as_str() == key);
            if let Some((_, other)) = interleaved {
                self.put(key, &other);
            }
            if self.conflicts.get() > 0 {
                self.conflicts.set(self.conflicts.get() - 1);
                return Err(SharedDataError::CasMismatch);
            }
            let mut data = self.data.borrow_mut();
            let current = data.get(key).map(|(_, c)| *c);
            if cas.is_some() && cas != current {
                return Err(SharedDataError::CasMismatch);
            }
            data.insert(key.to_string(), (value.to_vec(), current.unwrap_or(0) + 1));
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::fake::Memory;
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    /// Appends one byte to the value under "k".
    fn append(store: &Memory, byte: u8) -> Result<usize, SharedDataError> {
        compare_and_swap(store, "k", |bytes| {
            let mut v = bytes.unwrap_or_default().to_vec();
            v.push(byte);
            let n = v.len();
            Write::Store(v, n)
        })
    }

    #[test]
    fn a_write_retries_on_a_version_mismatch_and_reads_again() {
        let store = Memory::default();
        assert_eq!(append(&store, 1), Ok(1));
        store.conflicts.set(5);
        assert_eq!(append(&store, 2), Ok(2));
        assert_eq!(store.writes.get(), 1 + 6);
        assert_eq!(store.get("k").0, Some(vec![1, 2]));
    }

    #[test]
    fn endless_contention_gives_up_after_the_cap() {
        let store = Memory::default();
        store.conflicts.set(usize::MAX);
        assert_eq!(append(&store, 1), Err(SharedDataError::CasMismatch));
        assert_eq!(store.writes.get(), MAX_CAS_ATTEMPTS);
    }

    #[test]
    fn keeping_writes_nothing() {
        let store = Memory::default();
        store.conflicts.set(usize::MAX);
        let read = compare_and_swap(&store, "k", |bytes| Write::Keep(bytes.is_none()));
        assert_eq!(read, Ok(true));
        assert_eq!(store.writes.get(), 0);
    }
}
