//! What the host reads and answers through: the clock, the current request's headers and
//! properties, shared data, and a local reply.

use log::error;
use proxy_wasm::types::MapType;

use super::abi;
use crate::clock;
use crate::flow::RequestView;
use crate::shared::{SharedDataError, SharedStore};
use crate::verdict::LocalReply;

/// Answers the current request with `reply` (or resets it if Envoy refuses the reply).
pub(super) fn send(reply: &LocalReply) {
    let headers: Vec<(&str, &str)> = reply
        .headers
        .iter()
        .map(|(n, v)| (n.as_str(), v.as_str()))
        .collect();
    if let Err(status) = abi::send_http_response(
        reply.status,
        &reply.details,
        &headers,
        reply.body.as_bytes(),
    ) {
        error!(
            "ratelimit filter: cannot send the {} reply: status {status}",
            reply.status
        );
        let _ = abi::reset_http_request();
    }
}

/// The host's two clocks, for [`clock::Clock`].
pub(super) struct HostClock;

impl clock::Source for HostClock {
    fn monotonic_ns(&self) -> Option<u64> {
        abi::monotonic_time_ns()
    }

    fn wall_ns(&self) -> Option<u64> {
        abi::current_time_ns()
    }
}

thread_local! {
    /// This VM's clock.
    static CLOCK: clock::Clock = clock::Clock::default();
}

/// The time now, in nanoseconds, from this VM's clock: the one place the filter reads the time.
pub(super) fn now_ns() -> u64 {
    CLOCK.with(|c| c.now_ns(&HostClock))
}

/// Which clock this VM reads.
pub(super) fn clock_kind() -> clock::Kind {
    CLOCK.with(|c| c.kind(&HostClock))
}

/// The current request's headers and properties.
pub(super) struct HostRequest;

impl RequestView for HostRequest {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        abi::header_map_value(MapType::HttpRequestHeaders, name)
    }

    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        abi::property(path)
    }
}

/// proxy-wasm shared data (per `vm_id`, shared by all worker VMs of one Envoy process).
pub(super) struct HostShared;

impl SharedStore for HostShared {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        abi::get_shared_data(key)
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SharedDataError> {
        match abi::set_shared_data(key, value, cas) {
            Ok(()) => Ok(()),
            Err(abi::CAS_MISMATCH) => Err(SharedDataError::CasMismatch),
            Err(_) => Err(SharedDataError::Failed),
        }
    }
}
