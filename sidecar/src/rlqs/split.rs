//! The report splitter: re-frames the gRPC request stream of one quota stream so that every
//! message the service decodes fits `--max-body-bytes`, whatever size Envoy's reports grow to.
//!
//! Envoy sends one usage report holding every bucket it tracks (one bucket id and its counts per
//! `bucket_quota_usages` entry), so a report grows with the buckets. A gRPC message within the
//! limit passes unchanged. A larger uncompressed one is read field by field as it arrives
//! (`RateLimitQuotaUsageReports`: field 1 `domain`, field 2 repeated `bucket_quota_usages`) and
//! sent on as several reports of the same domain, each within the limit, so that what is held is
//! one outgoing report, whatever the incoming message's length. A bucket usage too large to fit a
//! report, or larger than any valid bucket id can make ([`super::bucket_id::max_usage_bytes`]),
//! is dropped unread: that bucket gets no assignment. Pure: bytes in, bytes out; [`super::body`]
//! puts it in front of the service. docs/rlqs.md, "Reports of any size".

use bytes::{BufMut, Bytes, BytesMut};
use prost::encoding::{
    decode_key, decode_varint, encode_key, encode_varint, encoded_len_varint, key_len, WireType,
};
use ratelimit_wire::MAX_NAME_BYTES;

/// A gRPC message's prefix: the compressed flag (1 byte) and the length (4 bytes, big-endian).
const PREFIX_BYTES: usize = 5;
const DOMAIN_FIELD: u32 = 1;
const USAGES_FIELD: u32 = 2;
const MAX_VARINT_BYTES: usize = 10;

/// The most a `domain` field may take in a report the splitter writes (a longer domain is not
/// carried: the quota service ignores it).
const MAX_DOMAIN_FIELD_BYTES: usize = 1 + 2 + MAX_NAME_BYTES;

/// What the splitter has seen so far (running totals).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Tally {
    /// gRPC messages received within the limit (passed unchanged).
    pub whole: u64,
    /// gRPC messages over the limit, sent on as several reports.
    pub split: u64,
    /// Bucket usages dropped: too large for a report, or for any valid bucket id.
    pub too_large: u64,
    /// Split messages whose rest could not be read (not a usage report): the usages read before
    /// it are sent on, the rest is skipped.
    pub unreadable: u64,
}

/// Where the splitter is in the byte stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Reading a message's prefix.
    Prefix,
    /// Copying the rest of a message within the limit.
    Pass,
    /// In a message being split: reading a field's key.
    Key,
    /// Reading the length of a length-delimited field of this number.
    Length(u32),
    /// Skipping a varint value.
    Varint,
    /// Skipping this many bytes.
    Skip(usize),
    /// Reading this many more bytes of the domain.
    Domain(usize),
    /// Copying this many more bytes of a usage into the report being filled.
    Usage(usize),
    /// Skipping the rest of an unreadable message.
    Rest,
}

/// Re-frames a stream of gRPC messages of `RateLimitQuotaUsageReports` (see the module).
#[derive(Debug)]
pub struct Splitter {
    /// The largest message payload the service accepts.
    limit: usize,
    /// The largest usage field (key, length and value) kept.
    max_usage_field: usize,
    state: State,
    /// Bytes of the current message not read yet.
    remaining: usize,
    /// A prefix or varint being read across chunks.
    pending: [u8; MAX_VARINT_BYTES],
    pending_len: usize,
    /// The current message's domain as it is read, then as an encoded field.
    domain_value: Vec<u8>,
    domain_field: Vec<u8>,
    /// The usage fields of the report being filled.
    batch: BytesMut,
    tally: Tally,
}

impl Splitter {
    /// A splitter for a service that accepts messages of at most `limit` bytes, dropping usages
    /// larger than `max_usage_bytes` (encoded, [`super::bucket_id::max_usage_bytes`]).
    pub fn new(limit: usize, max_usage_bytes: usize) -> Self {
        let usage_field =
            key_len(USAGES_FIELD) + encoded_len_varint(max_usage_bytes as u64) + max_usage_bytes;
        Self {
            limit,
            max_usage_field: usage_field.min(limit.saturating_sub(MAX_DOMAIN_FIELD_BYTES)),
            state: State::Prefix,
            remaining: 0,
            pending: [0; MAX_VARINT_BYTES],
            pending_len: 0,
            domain_value: Vec::new(),
            domain_field: Vec::new(),
            batch: BytesMut::new(),
            tally: Tally::default(),
        }
    }

    pub fn tally(&self) -> Tally {
        self.tally
    }

    /// Reads `chunk` (the next bytes of the request body) and appends the bytes to send on to
    /// `out`: whole messages' bytes as they come, split messages as complete reports.
    pub fn push(&mut self, mut chunk: Bytes, out: &mut Vec<Bytes>) {
        while !chunk.is_empty() {
            match self.state {
                State::Prefix => {
                    self.pending[self.pending_len] = chunk[0];
                    self.pending_len += 1;
                    let _ = chunk.split_to(1);
                    if self.pending_len == PREFIX_BYTES {
                        self.pending_len = 0;
                        self.start_message(out);
                    }
                }
                State::Pass => {
                    let n = self.remaining.min(chunk.len());
                    out.push(chunk.split_to(n));
                    self.remaining -= n;
                    if self.remaining == 0 {
                        self.state = State::Prefix;
                    }
                }
                State::Key | State::Length(_) | State::Varint => {
                    let byte = chunk.split_to(1)[0];
                    self.remaining -= 1;
                    self.on_varint_byte(byte, out);
                    self.end_of_message(out);
                }
                State::Skip(n) => {
                    // A fixed-width value may claim more than the message holds: the message
                    // then ends inside it (unreadable).
                    let take = n.min(chunk.len()).min(self.remaining);
                    let _ = chunk.split_to(take);
                    self.remaining -= take;
                    self.state = after(State::Skip(n - take));
                    self.end_of_message(out);
                }
                State::Rest => {
                    let take = self.remaining.min(chunk.len());
                    let _ = chunk.split_to(take);
                    self.remaining -= take;
                    self.end_of_message(out);
                }
                State::Domain(n) => {
                    let take = n.min(chunk.len());
                    self.domain_value.extend_from_slice(&chunk.split_to(take));
                    self.remaining -= take;
                    self.state = after(State::Domain(n - take));
                    if self.state == State::Key {
                        self.domain_read(out);
                    }
                    self.end_of_message(out);
                }
                State::Usage(n) => {
                    let take = n.min(chunk.len());
                    self.batch.extend_from_slice(&chunk.split_to(take));
                    self.remaining -= take;
                    self.state = after(State::Usage(n - take));
                    self.end_of_message(out);
                }
            }
        }
    }

    /// A message's prefix was read: pass the message, or start splitting it.
    fn start_message(&mut self, out: &mut Vec<Bytes>) {
        let prefix = self.pending[..PREFIX_BYTES].to_vec();
        let len = u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]) as usize;
        // Within the limit, compressed (which the service refuses whatever its size), or with a
        // flag gRPC does not define: the service reads (or refuses) it as sent.
        if len <= self.limit || prefix[0] != 0 {
            self.tally.whole += 1;
            out.push(Bytes::from(prefix));
            self.remaining = len;
            self.state = if len == 0 { State::Prefix } else { State::Pass };
            return;
        }
        self.tally.split += 1;
        self.remaining = len;
        self.domain_value.clear();
        self.domain_field.clear();
        self.state = State::Key;
    }

    /// One more byte of a varint (a key, a length, a value being skipped).
    fn on_varint_byte(&mut self, byte: u8, out: &mut Vec<Bytes>) {
        self.pending[self.pending_len] = byte;
        self.pending_len += 1;
        if byte & 0x80 != 0 {
            if self.pending_len == MAX_VARINT_BYTES {
                self.unreadable(out);
            }
            return;
        }
        let mut bytes = &self.pending[..self.pending_len];
        self.pending_len = 0;
        match self.state {
            State::Key => match decode_key(&mut bytes) {
                Ok((field, WireType::LengthDelimited)) => self.state = State::Length(field),
                Ok((DOMAIN_FIELD | USAGES_FIELD, _)) => self.unreadable(out),
                Ok((_, WireType::Varint)) => self.state = State::Varint,
                Ok((_, WireType::SixtyFourBit)) => self.state = State::Skip(8),
                Ok((_, WireType::ThirtyTwoBit)) => self.state = State::Skip(4),
                // Groups (never in these messages) and invalid keys.
                Ok(_) | Err(_) => self.unreadable(out),
            },
            State::Length(field) => match decode_varint(&mut bytes) {
                Ok(n) if n <= self.remaining as u64 => self.on_length(field, n as usize, out),
                Ok(_) | Err(_) => self.unreadable(out),
            },
            State::Varint => match decode_varint(&mut bytes) {
                Ok(_) => self.state = State::Key,
                Err(_) => self.unreadable(out),
            },
            _ => {}
        }
    }

    /// A length-delimited field of `n` bytes follows.
    fn on_length(&mut self, field: u32, n: usize, out: &mut Vec<Bytes>) {
        self.state = match field {
            DOMAIN_FIELD if n <= MAX_NAME_BYTES => {
                self.domain_value.clear();
                State::Domain(n)
            }
            USAGES_FIELD => {
                let size = key_len(USAGES_FIELD) + encoded_len_varint(n as u64) + n;
                if size > self.max_usage_field {
                    self.tally.too_large += 1;
                    State::Skip(n)
                } else {
                    if self.domain_field.len() + self.batch.len() + size > self.limit {
                        self.flush(out);
                    }
                    encode_key(USAGES_FIELD, WireType::LengthDelimited, &mut self.batch);
                    encode_varint(n as u64, &mut self.batch);
                    State::Usage(n)
                }
            }
            // A domain too long to be one (not carried), and fields these messages lack.
            _ => State::Skip(n),
        };
        self.state = after(self.state);
        if matches!((field, self.state), (DOMAIN_FIELD, State::Key)) && n <= MAX_NAME_BYTES {
            self.domain_read(out);
        }
    }

    /// The domain was read: the reports written from now on carry it. Usages read before it
    /// (Envoy writes the domain first) are sent on without it, so no report outgrows the limit.
    fn domain_read(&mut self, out: &mut Vec<Bytes>) {
        self.flush(out);
        self.domain_field.clear();
        encode_key(
            DOMAIN_FIELD,
            WireType::LengthDelimited,
            &mut self.domain_field,
        );
        encode_varint(self.domain_value.len() as u64, &mut self.domain_field);
        self.domain_field.extend_from_slice(&self.domain_value);
    }

    /// The rest of this message is not a usage report: skip it.
    fn unreadable(&mut self, out: &mut Vec<Bytes>) {
        self.tally.unreadable += 1;
        self.pending_len = 0;
        self.state = State::Rest;
        self.end_of_message(out);
    }

    /// At the end of a split message: send the last report, read the next prefix.
    fn end_of_message(&mut self, out: &mut Vec<Bytes>) {
        if self.remaining > 0 || matches!(self.state, State::Prefix | State::Pass) {
            return;
        }
        if !matches!(self.state, State::Key | State::Rest) {
            // The message ended inside a field.
            self.tally.unreadable += 1;
        }
        self.flush(out);
        self.pending_len = 0;
        self.state = State::Prefix;
    }

    /// Sends the report being filled, if it holds any usage.
    fn flush(&mut self, out: &mut Vec<Bytes>) {
        if self.batch.is_empty() {
            return;
        }
        let len = self.domain_field.len() + self.batch.len();
        let mut message = BytesMut::with_capacity(PREFIX_BYTES + len);
        message.put_u8(0);
        message.put_u32(len as u32);
        message.extend_from_slice(&self.domain_field);
        message.extend_from_slice(&self.batch);
        self.batch.clear();
        out.push(message.freeze());
    }
}

/// A field state with nothing left to read is the next key.
fn after(state: State) -> State {
    match state {
        State::Skip(0) | State::Domain(0) | State::Usage(0) => State::Key,
        s => s,
    }
}

#[cfg(test)]
mod tests;
