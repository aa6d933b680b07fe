//! [`RdmaMetadata`]: the JSON a passive operation hands to its peer, byte-compatible with Python
//! Dynamo's pydantic model.
//!
//! ```json
//! {"descriptors":[{"device":"cpu","ptr":140234,"size":4096}],
//!  "nixl_metadata":"b64:<base64 of zlib(level 6) of the NIXL agent metadata>",
//!  "notification_key":"<uuid4>","operation_kind":1}
//! ```
//!
//! The field order, names and compact form are exactly what `RdmaMetadata.model_dump_json()`
//! prints. Like the pydantic model (`extra="forbid"`), unknown keys are rejected.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::device::Device;
use crate::error::{Error, MetadataProblem, Result};
use crate::sync::label_enum;

label_enum! {
/// Which side a passive operation lets its peer take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum OperationKind {
    /// Made by a [`ReadableOperation`](crate::ReadableOperation): the peer reads (`1`).
    Read => "READ",
    /// Made by a [`WritableOperation`](crate::WritableOperation): the peer writes (`2`).
    Write => "WRITE",
}
}

impl OperationKind {
    /// The integer on the wire (`READ` = 1, `WRITE` = 2).
    pub fn as_u8(self) -> u8 {
        self as u8 + 1
    }
}

/// One remote memory range, as Python's `SerializedDescriptor`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SerializedDescriptor {
    /// Where the memory lives (`cpu`, `cuda:N`).
    pub device: Device,
    /// The address in the peer's process; never zero.
    #[serde(deserialize_with = "nonzero_ptr")]
    pub ptr: u64,
    /// The length in bytes.
    #[serde(deserialize_with = "size_field")]
    pub size: u64,
}

fn nonzero_ptr<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<u64, D::Error> {
    let v = d.deserialize_u64(WholeNumber)?;
    if v == 0 {
        return Err(serde::de::Error::custom("ptr cannot be zero (aka null)"));
    }
    u64::try_from(v).map_err(|_| serde::de::Error::custom(format!("ptr {v} is not an address")))
}

fn size_field<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<u64, D::Error> {
    let v = d.deserialize_u64(WholeNumber)?;
    u64::try_from(v).map_err(|_| serde::de::Error::custom(format!("size {v} must be an integer >= 0")))
}

/// A JSON integer of any sign (as `i128`; the callers name the field in their range errors),
/// read through the deserializer's `u64` path: a descriptor list is mostly these numbers, and the
/// `i128` path is the slow one. Anything but an integer is refused as `i128` would refuse it.
struct WholeNumber;

impl serde::de::Visitor<'_> for WholeNumber {
    type Value = i128;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("i128")
    }

    fn visit_u64<E: serde::de::Error>(self, v: u64) -> std::result::Result<i128, E> {
        Ok(v.into())
    }

    fn visit_i64<E: serde::de::Error>(self, v: i64) -> std::result::Result<i128, E> {
        Ok(v.into())
    }

    fn visit_u128<E: serde::de::Error>(self, v: u128) -> std::result::Result<i128, E> {
        i128::try_from(v).map_err(|_| E::invalid_value(serde::de::Unexpected::Other("u128"), &self))
    }

    fn visit_i128<E: serde::de::Error>(self, v: i128) -> std::result::Result<i128, E> {
        Ok(v)
    }
}

fn kind_field<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<u8, D::Error> {
    let v = i64::deserialize(d)?;
    if !(1..=3).contains(&v) {
        return Err(serde::de::Error::custom(format!(
            "operation_kind {v} must be an integer value of OperationKind (1 = READ, 2 = WRITE)"
        )));
    }
    Ok(v as u8)
}

/// The metadata a passive operation publishes and an active one consumes.
///
/// Build it with [`ReadableOperation::metadata`](crate::ReadableOperation::metadata) or
/// [`WritableOperation::metadata`](crate::WritableOperation::metadata); parse a peer's with
/// [`RdmaMetadata::from_json`] (or `str::parse`), which checks every field rule of the Python model
/// and reports the offending field.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RdmaMetadata {
    /// The passive side's memory, in order.
    #[serde(default)]
    pub descriptors: Vec<SerializedDescriptor>,
    /// The passive side's NIXL agent metadata: `b64:` + base64 of zlib, or (older Python) hex of
    /// zlib.
    #[serde(default)]
    pub nixl_metadata: String,
    /// The key the active side sends as the NIXL notification when it is done.
    #[serde(default)]
    pub notification_key: String,
    /// `1` (READ, from a readable) or `2` (WRITE, from a writable). Python's model admits `3`.
    #[serde(default, deserialize_with = "kind_field")]
    pub operation_kind: u8,
}

impl RdmaMetadata {
    /// Parses and validates a peer's metadata.
    ///
    /// # Errors
    /// [`Error::Metadata`] naming the field: JSON that does not parse, unknown keys, a zero `ptr`,
    /// an unknown device, `operation_kind` outside 1..=3, an empty descriptor list, an empty
    /// `nixl_metadata` or `notification_key`, mixed device kinds.
    pub fn from_json(s: &str) -> Result<Self> {
        let md: RdmaMetadata = serde_json::from_str(s.trim())
            .map_err(|e| Error::metadata_from(json_field(&e.to_string()), MetadataProblem::Json, e))?;
        md.validate()?;
        Ok(md)
    }

    /// The compact JSON Python's `model_dump_json()` prints.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("RdmaMetadata always serializes")
    }

    /// The kind of passive operation that made this metadata.
    ///
    /// # Errors
    /// [`Error::Metadata`] when `operation_kind` is neither READ (1) nor WRITE (2).
    pub fn kind(&self) -> Result<OperationKind> {
        let v = self.operation_kind;
        let kind = OperationKind::ALL.into_iter().find(|k| k.as_u8() == v);
        kind.ok_or_else(|| Error::metadata("operation_kind", MetadataProblem::UnknownKind(v)))
    }

    /// Checks what an active operation needs beyond the JSON shape.
    ///
    /// # Errors
    /// [`Error::Metadata`] naming the field that breaks a rule.
    pub fn validate(&self) -> Result<()> {
        let ds = &self.descriptors;
        let first = ds
            .first()
            .ok_or_else(|| Error::metadata("descriptors", MetadataProblem::NoDescriptors))?;
        if ds.iter().any(|d| d.device.kind() != first.device.kind()) {
            return Err(Error::metadata("descriptors", MetadataProblem::MixedDevices));
        }
        if ds.iter().any(|d| d.ptr.checked_add(d.size).is_none()) {
            return Err(Error::metadata("descriptors", MetadataProblem::RangeWraps));
        }
        if self.nixl_metadata.is_empty() {
            return Err(Error::metadata("nixl_metadata", MetadataProblem::Empty));
        }
        if self.notification_key.is_empty() {
            return Err(Error::metadata("notification_key", MetadataProblem::Empty));
        }
        self.kind()?;
        Ok(())
    }
}

impl FromStr for RdmaMetadata {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Self::from_json(s)
    }
}

impl fmt::Display for RdmaMetadata {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_json())
    }
}

/// Picks the field a serde_json message is about, for the error's `field`.
fn json_field(msg: &str) -> &'static str {
    if msg.contains("unknown field") {
        return "(extra key)";
    }
    const FIELDS: [(&str, &str); 7] = [
        ("descriptors", "descriptors"),
        ("nixl_metadata", "nixl_metadata"),
        ("notification_key", "notification_key"),
        ("operation_kind", "operation_kind"),
        ("device", "descriptors[].device"),
        ("ptr", "descriptors[].ptr"),
        ("size", "descriptors[].size"),
    ];
    FIELDS
        .iter()
        .find(|(k, _)| msg.contains(k))
        .map_or("json", |(_, f)| *f)
}

#[cfg(test)]
mod tests;
