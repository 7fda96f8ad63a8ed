//! Fabrics.
