//! The stream per worker, host side: the root context opens it (`open_grpc_stream`, to the
//! service of [`ratelimit_wire::stream`] on `sidecar.cluster`) and writes the calls on it, for the
//! worker ([`crate::flow::Host`]); what the stream is and what each call carries are the
//! worker's (`crate::flow::link`, `crate::flow::batch`).

use log::debug;
use prost::Message;
use proxy_wasm::hostcalls;
use ratelimit_wire::stream::{Call, STREAM_METHOD, STREAM_SERVICE};

use super::{abi, HostRequest, Plugin};
use crate::flow::{Host, RequestView};
use crate::verdict::LimiterError;

/// The host as the worker needs it in the middle of a root event.
pub struct HostIo<'a> {
    plugin: &'a Plugin,
    /// The root context: the stream is its (Envoy answers a stream to the context that opened
    /// it), so it is the effective one whenever the stream is opened or written.
    root: u32,
}

impl<'a> HostIo<'a> {
    pub fn new(plugin: &'a Plugin, root: u32) -> HostIo<'a> {
        HostIo { plugin, root }
    }
}

impl Host for HostIo<'_> {
    fn open_stream(&mut self) -> Result<u32, LimiterError> {
        let _ = abi::set_effective_context(self.root);
        open(self.plugin)
    }

    fn send(&mut self, token: u32, call: &Call) -> Result<(), LimiterError> {
        let _ = abi::set_effective_context(self.root);
        hostcalls::send_grpc_stream_message(token, Some(&call.encode_to_vec()), false).map_err(
            |status| {
                LimiterError::Dispatch(format!(
                    "cannot send on the stream to the sidecar: {status:?}"
                ))
            },
        )
    }

    fn request(&mut self, ctx: u32) -> Option<&dyn RequestView> {
        abi::set_effective_context(ctx).ok()?;
        Some(&HostRequest)
    }
}

fn open(plugin: &Plugin) -> Result<u32, LimiterError> {
    let mut metadata: Vec<(&str, &[u8])> = Vec::new();
    if let Some(a) = &plugin.setup.authorization {
        metadata.push(("authorization", a.as_bytes()));
    }
    let upstream = plugin.setup.grpc_service();
    let token = hostcalls::open_grpc_stream(&upstream, STREAM_SERVICE, STREAM_METHOD, metadata)
        .map_err(|status| {
            LimiterError::Dispatch(format!(
                "cannot open the stream to the sidecar: {status:?} (is cluster {:?} defined, with HTTP/2?)",
                plugin.setup.config.sidecar.cluster
            ))
        })?;
    debug!("ratelimit filter: opened the stream to the sidecar ({token})");
    Ok(token)
}
