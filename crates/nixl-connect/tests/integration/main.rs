//! The library's one integration-test binary: every test here runs against the real NIXL library
//! (installed by `bash scripts/setup.sh`), never a mock.

#[cfg(any(feature = "http", feature = "nats"))]
mod channels;
mod core;
// The waiter drives: these tests count callers' turns through `nixl_connect::testing`.
#[cfg(feature = "testing")]
mod driven;
#[cfg(feature = "etcd")]
mod etcd;
mod faults;
mod flood;
mod freed;
#[cfg(feature = "cuda")]
mod gpu;
mod hostile;
mod impostor;
mod limits;
mod local;
mod metrics;
mod pods;
mod quarantine;
mod soak;
mod soundness;
mod stall;
pub(crate) mod stop;
mod support;
mod untrusted;
