//! Implementations of the example services: an in-memory key-value store
//! and an echo service. The binaries and the tests serve these.

use crate::echo::{EchoReply, EchoRequest, echo_server::Echo};
use crate::kv::{
    DeleteReply, DeleteRequest, Entry, GetReply, GetRequest, PutReply, PutRequest, ScanReply,
    ScanRequest, kv_server::Kv,
};
use rpc_core::{Request, Response, Status};
use std::collections::BTreeMap;
use std::sync::RwLock;

/// Most entries one Scan returns when the request sets no limit.
pub const DEFAULT_SCAN_LIMIT: usize = 1000;
/// Longest key accepted.
pub const MAX_KEY_LEN: usize = 4096;

/// An in-memory, ordered key-value store.
#[derive(Debug, Default)]
pub struct KvStore {
    map: RwLock<BTreeMap<String, Vec<u8>>>,
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
}
