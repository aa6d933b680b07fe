//! Tests over the in-process loopback transport (feature `testing`), which need no NIXL library:
//! `scripts/test.sh` runs them with `NIXL_CONNECT_LIB` pointing at nothing.
//!
//! - `state`: the operations' and the engine's state machines, stepped without sleeping;
//! - `spin`: waits that stay awake before they park (`ConnectorBuilder::wait_spin`);
//! - `nolib`: what a user's own tests get from `nixl_connect::testing`, with NIXL never loaded.

mod nolib;
mod spin;
mod state;
