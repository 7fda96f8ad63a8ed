//! Implementations of the example services: an in-memory key-value store
//! and an echo service. The binaries and the tests serve these.

use crate::echo::{EchoReply, EchoRequest, StreamRequest, echo_server::Echo};
use crate::kv::{
    DeleteReply, DeleteRequest, Entry, GetReply, GetRequest, PutReply, PutRequest, ScanReply,
    ScanRequest, kv_server::Kv,
};
use rpc_core::codegen::Stream;
use rpc_core::{Bytes, Request, Response, Status};
use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::RwLock;
use std::task::{Context, Poll};

/// Most entries one Scan returns when the request sets no limit.
pub const DEFAULT_SCAN_LIMIT: usize = 1000;
/// Longest key accepted.
pub const MAX_KEY_LEN: usize = 4096;
/// Largest reply an echo `Stream` call may ask for, bytes.
pub const MAX_STREAM_REPLY: u32 = 1 << 30;

/// An in-memory, ordered key-value store.
#[derive(Debug, Default)]
pub struct KvStore {
    map: RwLock<BTreeMap<String, Bytes>>,
}

impl KvStore {
    /// An empty store.
    pub fn new() -> KvStore {
        KvStore::default()
    }

    /// Number of keys stored.
    pub fn len(&self) -> usize {
        self.map.read().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// True when nothing is stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn check_key(key: &str) -> Result<(), Status> {
    if key.is_empty() {
        return Err(Status::invalid_argument("key must not be empty"));
    }
    if key.len() > MAX_KEY_LEN {
        return Err(Status::invalid_argument(format!(
            "key of {} bytes exceeds {MAX_KEY_LEN}",
            key.len()
        )));
    }
    Ok(())
}

impl Kv for KvStore {
    async fn put(&self, request: Request<PutRequest>) -> Result<Response<PutReply>, Status> {
        let PutRequest { key, value } = request.into_inner();
        check_key(&key)?;
        // Kept in a buffer of its own: `Vec::from` takes over the
        // allocation of a small value (copied out of the receive ring) and
        // copies a large one, which shares the buffer it was read into by
        // rendezvous (rounded up to a size class, and registered memory
        // on rdma://) for as long as it is kept.
        let value = Bytes::from(Vec::from(value));
        let replaced = self
            .map
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, value)
            .is_some();
        Ok(Response::new(PutReply { replaced }))
    }

    async fn get(&self, request: Request<GetRequest>) -> Result<Response<GetReply>, Status> {
        let key = &request.get_ref().key;
        check_key(key)?;
        let value = self
            .map
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(key)
            .cloned();
        Ok(Response::new(GetReply { value }))
    }

    async fn delete(
        &self,
        request: Request<DeleteRequest>,
    ) -> Result<Response<DeleteReply>, Status> {
        let key = &request.get_ref().key;
        check_key(key)?;
        let existed = self
            .map
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(key)
            .is_some();
        Ok(Response::new(DeleteReply { existed }))
    }

    async fn scan(&self, request: Request<ScanRequest>) -> Result<Response<ScanReply>, Status> {
        let ScanRequest { prefix, limit } = request.into_inner();
        let limit = if limit == 0 {
            DEFAULT_SCAN_LIMIT
        } else {
            limit as usize
        };
        let map = self.map.read().unwrap_or_else(|e| e.into_inner());
        let mut matching = map
            .range(prefix.clone()..)
            .take_while(|(k, _)| k.starts_with(&prefix));
        let entries: Vec<Entry> = matching
            .by_ref()
            .take(limit)
            .map(|(k, v)| Entry {
                key: k.clone(),
                value: v.clone(),
            })
            .collect();
        let truncated = matching.next().is_some();
        Ok(Response::new(ScanReply { entries, truncated }))
    }
}

/// Echoes payloads and metadata back.
#[derive(Debug, Default, Clone, Copy)]
pub struct EchoService;

impl Echo for EchoService {
    async fn echo(&self, request: Request<EchoRequest>) -> Result<Response<EchoReply>, Status> {
        let metadata = request.metadata().clone();
        let payload = request.into_inner().payload;
        Ok(Response::from_parts(metadata, EchoReply { payload }))
    }

    type StreamStream = Replies;

    async fn stream(&self, request: Request<StreamRequest>) -> Result<Response<Replies>, Status> {
        let StreamRequest { count, size } = request.into_inner();
        if size > MAX_STREAM_REPLY {
            return Err(Status::invalid_argument(format!(
                "replies of {size} bytes exceed {MAX_STREAM_REPLY}"
            )));
        }
        Ok(Response::new(Replies(StreamPayloads::new(
            count,
            size as usize,
        ))))
    }
}

/// The payloads of an echo `Stream` call, in order: `count` of `size`
/// bytes, each a copy of one zeroed template with its index written over
/// the first (up to) eight bytes. A copy costs an allocation and a
/// `memcpy` of `size` bytes per message, which is what any producer of
/// fresh messages pays.
#[derive(Debug, Clone)]
pub struct StreamPayloads {
    template: Vec<u8>,
    next: u64,
    count: u64,
}

impl StreamPayloads {
    /// The `count` payloads of `size` bytes.
    pub fn new(count: u64, size: usize) -> StreamPayloads {
        StreamPayloads {
            template: vec![0; size],
            next: 0,
            count,
        }
    }

    /// Whether `payload` is the one at `index` of a stream of `size`-byte
    /// payloads (its length and index; the zeros are not looked at).
    pub fn matches(payload: &[u8], size: usize, index: u64) -> bool {
        if payload.len() != size {
            return false;
        }
        match payload.first_chunk::<8>() {
            Some(head) => u64::from_le_bytes(*head) == index,
            None => payload[..] == index.to_le_bytes()[..size],
        }
    }
}

impl Iterator for StreamPayloads {
    type Item = Vec<u8>;

    fn next(&mut self) -> Option<Vec<u8>> {
        if self.next >= self.count {
            return None;
        }
        let mut payload = self.template.clone();
        let n = payload.len().min(8);
        payload[..n].copy_from_slice(&self.next.to_le_bytes()[..n]);
        self.next += 1;
        Some(payload)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        match usize::try_from(self.count - self.next) {
            Ok(left) => (left, Some(left)),
            Err(_) => (usize::MAX, None),
        }
    }
}

/// The response stream of [`EchoService`]'s `Stream`: [`StreamPayloads`] as
/// `EchoReply`s, every one ready at once.
#[derive(Debug, Clone)]
pub struct Replies(pub StreamPayloads);

impl Stream for Replies {
    type Item = Result<EchoReply, Status>;

    fn poll_next(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        Poll::Ready(self.0.next().map(|payload| {
            Ok(EchoReply {
                payload: payload.into(),
            })
        }))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.0.size_hint()
    }
}
