//! The CLI's one integration-test binary: the `nixl-connect` commands against each other and
//! against Python Dynamo workers, over the real NIXL library.

mod commands;
mod interop;
mod metrics;
mod sendrecv;
#[path = "../../../nixl-connect/tests/integration/stop.rs"]
pub(crate) mod stop;
mod support;
