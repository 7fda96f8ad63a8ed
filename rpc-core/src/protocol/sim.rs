//! Simulated sender/receiver pair over the pure protocol (property tests).
