//! The redis-rs transport (feature `redis-rs`).

use super::Target;
use crate::backend::redis::RedisOptions;
use crate::error::{Error, Result};

/// Opens what `url` names with `options`.
pub(in crate::backend::redis) async fn open(
    _url: &str,
    _options: &RedisOptions,
    _wait: bool,
) -> Result<Target> {
    Err(Error::Unsupported("not yet".into()))
}
