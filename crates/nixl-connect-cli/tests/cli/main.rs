//! The CLI's one integration-test binary: the `nixl-connect` commands against each other and
//! against Python Dynamo workers, over the real NIXL library.

mod commands;
mod interop;
mod sendrecv;
mod support;
