//! The test world: private mount namespaces and container-model processes,
//! shared by the integration tests, the demo and the heal-latency harness.
pub mod container;
