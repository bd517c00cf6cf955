//! A small client of the daemon's socket, used by `query`, `bench` and the tests.

use std::path::Path;

use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

use crate::protocol::{
    decode_response, encode_describe, encode_inline_share, encode_lease_share, encode_lease_request, encode_multi_request, encode_policy_request, encode_refund, encode_request_with, encode_reserve, encode_settle, Algorithm, CheckArgs, FailPolicy, ItemArgs, LeaseArgs, PolicyCheckArgs, PolicyLeaseArgs, encode_policy_lease_request, Response,
    ResponseError, HANDLE_LEN,
};

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Protocol(#[from] ResponseError),
    #[error("the daemon closed the connection")]
    Closed,
    #[error("response id {got} does not match request id {want}")]
    IdMismatch { want: u32, got: u32 },
}

/// One connection, one request at a time (like an Nginx worker's cosocket).
#[derive(Debug)]
pub struct Client {
    stream: UnixStream,
    rbuf: BytesMut,
    wbuf: BytesMut,
    next_id: u32,
}

impl Client {
    pub async fn connect(path: &Path) -> std::io::Result<Self> {
        Ok(Self { stream: UnixStream::connect(path).await?, rbuf: BytesMut::with_capacity(1024), wbuf: BytesMut::with_capacity(1024), next_id: 1 })
    }

    /// Sends one check (the log algorithm) and waits for its response.
    pub async fn check(&mut self, args: &CheckArgs<'_>) -> Result<Response, ClientError> {
        self.check_with(args, Algorithm::Log).await
    }

    /// Sends one check counted by `algorithm` and waits for its response.
    pub async fn check_with(&mut self, args: &CheckArgs<'_>, algorithm: Algorithm) -> Result<Response, ClientError> {
        let id = self.take_id();
        encode_request_with(id, args, algorithm, &mut self.wbuf);
        self.round_trip(id).await
    }

    /// Sends one LEASE_SHARE (op 10, `args.cost` units wanted) and waits for
    /// its response: `count` units granted, valid for `retry_after_ms` from
    /// this send.
    pub async fn lease_share(&mut self, args: &PolicyCheckArgs<'_>) -> Result<Response, ClientError> {
        let id = self.take_id();
        encode_lease_share(id, args, &mut self.wbuf);
        self.round_trip(id).await
    }

    /// Sends one worker share of an inline limit (CHECK with the share
    /// flag, `args.cost` units wanted) and waits for its response, as
    /// `lease_share`.
    pub async fn inline_share(&mut self, args: &CheckArgs<'_>) -> Result<Response, ClientError> {
        let id = self.take_id();
        encode_inline_share(id, args, &mut self.wbuf);
        self.round_trip(id).await
    }

    /// Sends one CHECK_POLICY request and waits for its response.
    pub async fn check_policy(&mut self, args: &PolicyCheckArgs<'_>) -> Result<Response, ClientError> {
        let id = self.take_id();
        encode_policy_request(id, args, &mut self.wbuf);
        self.round_trip(id).await
    }

    /// Sends one ACQUIRE (`op` 5) or RELEASE (`op` 6) and waits for its response.
    pub async fn lease(&mut self, op: u8, args: &LeaseArgs<'_>) -> Result<Response, ClientError> {
        let id = self.take_id();
        encode_lease_request(id, op, args, &mut self.wbuf);
        self.round_trip(id).await
    }

    /// Sends one ACQUIRE_POLICY (op 7; with `release`, the release of the
    /// lease) and waits for its response.
    pub async fn policy_lease(&mut self, release: bool, args: &PolicyLeaseArgs<'_>) -> Result<Response, ClientError> {
        let id = self.take_id();
        encode_policy_lease_request(id, release, args, &mut self.wbuf);
        self.round_trip(id).await
    }

    /// Sends one CHECK_POLICY of several items (or one refundable) and
    /// waits for its response.
    pub async fn check_multi(&mut self, on_error: FailPolicy, local_limit: u32, refundable: bool, items: &[ItemArgs<'_>]) -> Result<Response, ClientError> {
        let id = self.take_id();
        encode_multi_request(id, on_error, local_limit, refundable, items, &mut self.wbuf);
        self.round_trip(id).await
    }

    /// Sends one REFUND of a refundable check's handle and items.
    pub async fn refund(&mut self, handle: &[u8; HANDLE_LEN], items: &[ItemArgs<'_>]) -> Result<Response, ClientError> {
        let id = self.take_id();
        encode_refund(id, handle, items, &mut self.wbuf);
        self.round_trip(id).await
    }

    /// Sends one reserve (CHECK_POLICY with the settle flag) of `item`,
    /// whose cost is the estimate.
    pub async fn reserve(&mut self, on_error: FailPolicy, local_limit: u32, item: &ItemArgs<'_>) -> Result<Response, ClientError> {
        self.reserve_items(on_error, local_limit, std::slice::from_ref(item)).await
    }

    /// Sends one reserve of several items (policies), all or nothing; each
    /// cost is that policy's estimate.
    pub async fn reserve_items(&mut self, on_error: FailPolicy, local_limit: u32, items: &[ItemArgs<'_>]) -> Result<Response, ClientError> {
        let id = self.take_id();
        encode_reserve(id, on_error, local_limit, items, &mut self.wbuf);
        self.round_trip(id).await
    }

    /// Sends one SETTLE (op 9): the reserve's handle and item, its cost the actual.
    pub async fn settle(&mut self, handle: &[u8; HANDLE_LEN], item: &ItemArgs<'_>) -> Result<Response, ClientError> {
        self.settle_items(handle, std::slice::from_ref(item)).await
    }

    /// Sends one SETTLE of a reserve of several items: the reserve's items
    /// in its order, each cost the actual.
    pub async fn settle_items(&mut self, handle: &[u8; HANDLE_LEN], items: &[ItemArgs<'_>]) -> Result<Response, ClientError> {
        let id = self.take_id();
        encode_settle(id, handle, items, &mut self.wbuf);
        self.round_trip(id).await
    }

    /// Sends one DESCRIBE_POLICY (op 8) of `name` (sent as given, valid or
    /// not) and waits for its answer; `PolicyDescription::from_response`
    /// reads it.
    pub async fn describe(&mut self, name: &[u8]) -> Result<Response, ClientError> {
        let id = self.take_id();
        encode_describe(id, name, &mut self.wbuf);
        self.round_trip(id).await
    }

    /// The next request's id; the write buffer emptied for it.
    fn take_id(&mut self) -> u32 {
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1);
        self.wbuf.clear();
        id
    }

    /// Sends the write buffer and reads the answer, which must be to `id`.
    async fn round_trip(&mut self, id: u32) -> Result<Response, ClientError> {
        self.stream.write_all(&self.wbuf).await?;
        let r = self.read_response().await?;
        if r.id != id {
            return Err(ClientError::IdMismatch { want: id, got: r.id });
        }
        Ok(r)
    }

    /// Writes raw bytes (tests of malformed input).
    pub async fn send_raw(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.stream.write_all(bytes).await
    }

    /// Reads the next response frame.
    pub async fn read_response(&mut self) -> Result<Response, ClientError> {
        loop {
            if let Some(r) = decode_response(&mut self.rbuf)? {
                return Ok(r);
            }
            if self.stream.read_buf(&mut self.rbuf).await? == 0 {
                return Err(ClientError::Closed);
            }
        }
    }

    /// Half-closes the write side: the daemon sees EOF.
    pub async fn shutdown_write(&mut self) -> std::io::Result<()> {
        self.stream.shutdown().await
    }
}
