//! The stream per worker: the gRPC service each worker of an Envoy opens once to its sidecar
//! ([`STREAM_PATH`], bidirectional), instead of an HTTP callout per batch. A worker sends each
//! coalesced batch as one [`Call`] and the sidecar answers it with one [`Answer`] of the same
//! `id`, in the order its decisions finish (not the order the calls came). A call's `body` is the
//! body the HTTP endpoint of its kind takes, and an answer's `status` and `body` are what that
//! endpoint answers, so both transports share one contract. How the filter uses it:
//! docs/fast-paths.md#the-stream-per-worker.

/// The service's full name, as `open_grpc_stream` takes it.
pub const STREAM_SERVICE: &str = "ratelimit.wire.v1.Sidecar";
/// The method's name.
pub const STREAM_METHOD: &str = "Calls";
/// The HTTP/2 `:path` of the stream.
pub const STREAM_PATH: &str = "/ratelimit.wire.v1.Sidecar/Calls";

/// What a call on the stream asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum Kind {
    /// Decisions: `body` is a [`crate::DecideRequest`], as `POST /v1/decide` takes it.
    Decide = 0,
    /// Settlements: `body` is a [`crate::SettleRequest`], as `POST /v1/settle` takes it.
    Settle = 1,
    /// Slot renewals and releases: `body` is a [`crate::SlotsRequest`], as `POST /v1/slots`
    /// takes it.
    Slots = 2,
    /// The policy epoch, as `GET /v1/epoch` answers it (`body` empty).
    Epoch = 3,
}

/// One call from a worker.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Call {
    /// The worker's id for the call, echoed by its answer (unique among its calls in flight).
    #[prost(uint32, tag = "1")]
    pub id: u32,
    #[prost(enumeration = "Kind", tag = "2")]
    pub kind: i32,
    #[prost(bytes = "vec", tag = "3")]
    pub body: Vec<u8>,
}

/// The sidecar's answer to the call with the same `id`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Answer {
    #[prost(uint32, tag = "1")]
    pub id: u32,
    /// The HTTP status the endpoint of the call's kind answers (200, 400, 500, 503).
    #[prost(uint32, tag = "2")]
    pub status: u32,
    #[prost(bytes = "vec", tag = "3")]
    pub body: Vec<u8>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    #[test]
    fn a_call_and_an_answer_survive_their_encoding() {
        let call = Call {
            id: u32::MAX,
            kind: Kind::Decide as i32,
            body: br#"{"requests":[]}"#.to_vec(),
        };
        assert_eq!(Call::decode(call.encode_to_vec().as_slice()).unwrap(), call);
        let answer = Answer {
            id: 7,
            status: 503,
            body: b"{}".to_vec(),
        };
        assert_eq!(
            Answer::decode(answer.encode_to_vec().as_slice()).unwrap(),
            answer
        );
    }

    #[test]
    fn an_unknown_kind_is_told_apart() {
        let call = Call {
            id: 1,
            kind: 9,
            body: Vec::new(),
        };
        let decoded = Call::decode(call.encode_to_vec().as_slice()).unwrap();
        assert!(Kind::try_from(decoded.kind).is_err());
    }

    #[test]
    fn a_truncated_message_is_an_error() {
        let call = Call {
            id: 1,
            kind: 0,
            body: vec![b'x'; 100],
        };
        let bytes = call.encode_to_vec();
        assert!(Call::decode(&bytes[..bytes.len() - 1]).is_err());
    }
}
