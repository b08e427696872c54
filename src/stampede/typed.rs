//! Typed values through serde (feature `serde`), stored as JSON.

use serde::de::DeserializeOwned;
use serde::Serialize;

use super::*;

fn decode<T: DeserializeOwned>(key: &str, bytes: &[u8]) -> Result<T> {
    serde_json::from_slice(bytes).map_err(|e| Error::LoadFailed {
        message: format!("the cached value of {key:?} could not be decoded: {e}"),
    })
}

impl Cache {
    /// [`get_with`](Self::get_with) for a typed value, stored as JSON (feature `serde`).
    /// Every caller decodes its own copy from the shared bytes.
    ///
    /// ```
    /// use std::time::Duration;
    /// #[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq)]
    /// struct User { id: u32, name: String }
    /// # futures::executor::block_on(async {
    /// let cache = redlease::Cache::new(redlease::MemoryBackend::new());
    /// let user: User = cache
    ///     .get_typed_with("user:7", Duration::from_secs(30), || async {
    ///         User { id: 7, name: "Grace".into() }
    ///     })
    ///     .await?;
    /// assert_eq!(user.name, "Grace");
    /// # Ok::<(), redlease::Error>(()) }).unwrap();
    /// ```
    ///
    /// # Errors
    ///
    /// As [`get_with`](Self::get_with); [`Error::LoadFailed`] if the value cannot be encoded,
    /// or the cached bytes cannot be decoded as `T` (a value written by another version).
    ///
    /// # Cancel safety
    ///
    /// As [`get_with`](Self::get_with).
    #[cfg_attr(docsrs, doc(cfg(feature = "serde")))]
    pub async fn get_typed_with<T, F, Fut>(&self, key: &str, ttl: Duration, loader: F) -> Result<T>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = T> + Send + 'static,
    {
        let load: Loader = Box::new(move || {
            Box::pin(async move {
                let value = loader().await;
                serde_json::to_vec(&value).map(Bytes::from).map_err(|e| {
                    let e = encode_error(e);
                    LoadError {
                        message: e.to_string(),
                        error: Arc::new(e),
                    }
                })
            })
        });
        let bytes = match self.fetch(key, ttl, TypeId::of::<Error>(), load).await {
            Ok(bytes) => bytes,
            Err(Fail::Cache(e)) => return Err(e),
            Err(Fail::Loader(any)) => {
                return Err(match any.downcast::<Error>() {
                    Ok(e) => duplicate(&e),
                    Err(_) => Error::LoadFailed {
                        message: "the loader's error had another type".into(),
                    },
                })
            }
        };
        decode(key, &bytes)
    }

    /// [`try_get_with`](Self::try_get_with) for a typed value, stored as JSON (feature
    /// `serde`).
    ///
    /// ```
    /// use std::{sync::Arc, time::Duration};
    /// # futures::executor::block_on(async {
    /// let cache = redlease::Cache::new(redlease::MemoryBackend::new());
    /// let n: u64 = cache
    ///     .try_get_typed_with("count", Duration::from_secs(5), || async {
    ///         Ok::<u64, redlease::Error>(42)
    ///     })
    ///     .await?;
    /// assert_eq!(n, 42);
    /// # Ok::<(), Arc<redlease::Error>>(()) }).unwrap();
    /// ```
    ///
    /// # Errors
    ///
    /// As [`try_get_with`](Self::try_get_with); encoding and decoding failures as
    /// `E::from(Error::LoadFailed { .. })`.
    ///
    /// # Cancel safety
    ///
    /// As [`get_with`](Self::get_with).
    #[cfg_attr(docsrs, doc(cfg(feature = "serde")))]
    pub async fn try_get_typed_with<T, F, Fut, E>(
        &self,
        key: &str,
        ttl: Duration,
        loader: F,
    ) -> Result<T, Arc<E>>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        E: From<Error> + fmt::Display + Send + Sync + 'static,
    {
        let load: Loader = Box::new(move || {
            Box::pin(async move {
                let failed = |e: E| LoadError {
                    message: e.to_string(),
                    error: Arc::new(e),
                };
                let value = loader().await.map_err(failed)?;
                serde_json::to_vec(&value)
                    .map(Bytes::from)
                    .map_err(|e| failed(E::from(encode_error(e))))
            })
        });
        let bytes = match self.fetch(key, ttl, TypeId::of::<E>(), load).await {
            Ok(bytes) => bytes,
            Err(Fail::Cache(e)) => return Err(Arc::new(E::from(e))),
            Err(Fail::Loader(any)) => {
                return Err(any.downcast::<E>().unwrap_or_else(|_| {
                    Arc::new(E::from(Error::LoadFailed {
                        message: "the loader's error had another type".into(),
                    }))
                }))
            }
        };
        decode(key, &bytes).map_err(|e| Arc::new(E::from(e)))
    }
}
