//! Reading what Dynamo's Rust media path publishes.
//!
//! Dynamo's frontend (`dynamo-llm`, `preprocessor/media`) decodes an image into `dynamo-memory`
//! `SystemStorage`, registers it with a `dynamo-memory` `NixlAgent` (UCX), and sends the next
//! stage an `RdmaMediaDataDescriptor` as JSON: `nixl_metadata` (`"b64:"` + base64 of the zlib of
//! the agent's metadata), `nixl_descriptor` (`addr`, `size`, `mem_type` `"Dram"` or `"Vram"`,
//! `device_id`), and the tensor's `shape` and `dtype`. Whoever holds it reads it over NIXL with a
//! notification key of its own, which the publisher never looks at. [`metadata`] makes the
//! nixl-connect [`RdmaMetadata`] of such a publication, for `Connector::begin_read`.

use nixl_connect::RdmaMetadata;
use serde_json::{json, Value};

/// A publication that is not an `RdmaMediaDataDescriptor` nixl-connect can read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MediaError {
    /// A field is missing or of the wrong type.
    #[error("the media descriptor's `{0}` is missing or not what Dynamo writes there")]
    Field(&'static str),
    /// A memory type other than host (`Dram`) or device (`Vram`) memory.
    #[error("the media descriptor's memory type {0:?} is not host or device memory")]
    MemType(String),
    /// The metadata made does not validate (what nixl-connect says about it).
    #[error("the media descriptor does not make valid nixl-connect metadata: {0}")]
    Metadata(#[source] nixl_connect::Error),
}

/// The nixl-connect metadata of the publication `descriptor` (an `RdmaMediaDataDescriptor` as
/// JSON), read with the notification key `key` (any string unique to this read).
///
/// # Errors
/// [`MediaError`] for a descriptor that is not Dynamo's media shape.
pub fn metadata(descriptor: &Value, key: &str) -> Result<RdmaMetadata, MediaError> {
    let nixl_metadata = descriptor["nixl_metadata"]
        .as_str()
        .ok_or(MediaError::Field("nixl_metadata"))?;
    let d = &descriptor["nixl_descriptor"];
    let addr = d["addr"]
        .as_u64()
        .ok_or(MediaError::Field("nixl_descriptor.addr"))?;
    let size = d["size"]
        .as_u64()
        .ok_or(MediaError::Field("nixl_descriptor.size"))?;
    let device_id = d["device_id"].as_u64().unwrap_or(0);
    let device = match d["mem_type"]
        .as_str()
        .ok_or(MediaError::Field("nixl_descriptor.mem_type"))?
    {
        "Dram" => "cpu".to_string(),
        "Vram" => format!("cuda:{device_id}"),
        other => return Err(MediaError::MemType(other.to_string())),
    };
    let md: RdmaMetadata = serde_json::from_value(json!({
        "descriptors": [{"device": device, "ptr": addr, "size": size}],
        "nixl_metadata": nixl_metadata,
        "notification_key": key,
        "operation_kind": 1,
    }))
    .map_err(|_| MediaError::Field("nixl_descriptor"))?;
    md.validate().map_err(MediaError::Metadata)?;
    Ok(md)
}
