//! The long runs' stages (`make reliability`), as library code their binaries call.

pub mod reliability;
