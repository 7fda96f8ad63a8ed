//! Examples (in progress).
