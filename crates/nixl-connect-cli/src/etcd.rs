//! `etcd://` locations for `serve --publish` and `read`/`write --metadata`: metadata through the
//! etcd a deployment runs (the library's `channel::etcd`).
//!
//! `etcd://HOST:PORT[,HOST:PORT...]/KEY`: the endpoints, then the key. For `serve --publish` a
//! location ending in `/` is a prefix, under which a fresh name is chosen.

use std::time::Duration;

use anyhow::{bail, Context, Result};
use nixl_connect::channel::etcd::{EtcdChannel, EtcdPublication};
use nixl_connect::RdmaMetadata;

/// An `etcd://` location taken apart.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Location {
    pub(crate) endpoints: Vec<String>,
    /// The key, or the prefix when it ends with `/`.
    pub(crate) key: String,
}

impl Location {
    /// `Some` for an `etcd://` location (an error if it is malformed), `None` for anything else.
    pub(crate) fn parse(s: &str) -> Option<Result<Self>> {
        let rest = s.strip_prefix("etcd://")?;
        Some(match rest.split_once('/') {
            Some((hosts, key)) if !hosts.is_empty() && !key.is_empty() => Ok(Location {
                endpoints: hosts.split(',').map(str::to_string).collect(),
                key: key.to_string(),
            }),
            _ => Err(anyhow::anyhow!(
                "{s:?} is not an etcd location: write etcd://HOST:PORT/KEY (or a prefix ending in /)"
            )),
        })
    }

    fn url(&self, key: &str) -> String {
        format!("etcd://{}/{key}", self.endpoints.join(","))
    }
}

async fn connect(loc: &Location, timeout: Duration) -> Result<EtcdChannel> {
    EtcdChannel::connect(&loc.endpoints, timeout)
        .await
        .with_context(|| {
            format!(
                "connecting to etcd at {} (is it running, and reachable from here?)",
                loc.endpoints.join(",")
            )
        })
}

/// Publishes `md` at `loc` (a key, or a prefix ending in `/`); returns the publication and the
/// location the peer passes to `read`/`write --metadata`.
pub(crate) async fn publish(
    loc: &Location,
    md: &RdmaMetadata,
    timeout: Duration,
) -> Result<(EtcdPublication, String)> {
    let ch = connect(loc, timeout).await?;
    let p = if loc.key.ends_with('/') {
        ch.with_prefix(loc.key.clone()).publish(md).await?
    } else {
        match loc.key.rsplit_once('/') {
            Some((prefix, name)) => ch.with_prefix(format!("{prefix}/")).publish_as(name, md).await?,
            None => ch.with_prefix("").publish_as(&loc.key, md).await?,
        }
    };
    let url = loc.url(p.key());
    Ok((p, url))
}

/// The metadata at `loc`, waiting up to `timeout` for it to be published.
pub(crate) async fn fetch(loc: &Location, timeout: Duration) -> Result<RdmaMetadata> {
    if loc.key.ends_with('/') {
        bail!("etcd location {}: name the key, not a prefix", loc.url(&loc.key));
    }
    let ch = connect(loc, timeout).await?;
    Ok(ch.fetch(&loc.key, timeout).await?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cli_etcd_locations_parse_or_say_how_to_write_them() {
        assert!(Location::parse("http://x/y").is_none());
        assert!(Location::parse("-").is_none());
        assert_eq!(
            Location::parse("etcd://10.0.0.1:2379,10.0.0.2:2379/dynamo/nc/job-1")
                .unwrap()
                .unwrap(),
            Location {
                endpoints: vec!["10.0.0.1:2379".into(), "10.0.0.2:2379".into()],
                key: "dynamo/nc/job-1".into()
            }
        );
        for bad in ["etcd://", "etcd://host:2379", "etcd://host:2379/", "etcd:///key"] {
            let e = Location::parse(bad).unwrap().unwrap_err();
            assert!(e.to_string().contains("etcd://HOST:PORT/KEY"), "{bad}: {e}");
        }
    }
}
