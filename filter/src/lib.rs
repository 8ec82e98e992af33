//! The proxy-wasm rate-limit filter (skeleton; see issue 3).
