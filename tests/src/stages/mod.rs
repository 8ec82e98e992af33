//! The long runs' stages (`make reliability`), as library code their binaries call.

pub mod bench;
pub mod reliability;
pub mod scale;
