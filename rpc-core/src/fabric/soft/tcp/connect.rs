//! Setting a tcp:// queue pair up, dialed or accepted: the socket's
//! options and the [`bootstrap`] handshake, then the socket made
//! non-blocking and handed to its completion queue's poller. The accepting
//! side sends its hello once established.

use super::{TcpConn, TcpWire};
use crate::fabric::bootstrap::{self, Hello, HelloFabric, Link};
use crate::fabric::gate::Admitted;
use crate::fabric::soft::{
    CqInner, Ctx, Lending, RegionInner, SoftQp, SoftRegion, Wire, next_qp_num,
};
use crate::fabric::{Connected, FabricError, FabricUrl, LocalSetup, PeerRing, Region};
use std::io::IoSlice;
use std::net::TcpStream;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Weak};
use std::time::Duration;

fn local_hello(qp_num: u32, local: &LocalSetup<'_, SoftRegion>) -> Hello {
    Hello {
        fabric: HelloFabric::Tcp,
        qp_num,
        psn: 0,
        lid: 0,
        gid: [0; 16],
        mtu: 0,
        ring: PeerRing {
            addr: local.ring.addr(),
            len: local.ring.len() as u64,
            rkey: local.ring.rkey(),
            max_message: local.max_message,
            max_streams: local.max_streams,
        },
    }
}

pub(crate) fn connect(
    ctx: &Arc<Ctx>,
    cq: &Arc<CqInner>,
    url: &FabricUrl,
    local: LocalSetup<'_, SoftRegion>,
) -> Result<Connected<SoftQp>, FabricError> {
    // The whole connect, dial and handshakes, is bounded by the timeout.
    let deadline = crate::bounded_deadline(local.timeout);
    let stream = bootstrap::dial(url, local.timeout)?;
    let qp_num = next_qp_num();
    setup(&stream, local.timeout)?;
    let mut link = Link::client(stream, local.tls.as_ref(), url, deadline)?;
    let hello = local_hello(qp_num, &local);
    bootstrap::send(&mut link, &hello)?;
    let peer = bootstrap::client_exchange(
        &mut link,
        &hello,
        HelloFabric::Tcp,
        local.credential.as_deref(),
    )?;
    finish(ctx, cq, link, qp_num, local.ring.binding(), peer, None)
}

pub(crate) fn accept(
    ctx: &Arc<Ctx>,
    cq: &Arc<CqInner>,
    admitted: Admitted,
    local: LocalSetup<'_, SoftRegion>,
) -> Result<Connected<SoftQp>, FabricError> {
    let qp_num = next_qp_num();
    let hello = local_hello(qp_num, &local);
    let (peer, identity) = (admitted.hello, admitted.identity.clone());
    finish(
        ctx,
        cq,
        admitted.into_link(),
        qp_num,
        local.ring.binding(),
        peer,
        Some((hello, identity)),
    )
}

fn setup(stream: &TcpStream, timeout: Duration) -> Result<(), FabricError> {
    stream
        .set_nodelay(true)
        .map_err(|e| FabricError::io("set_nodelay", e))?;
    stream
        .set_read_timeout(Some(timeout))
        .map_err(|e| FabricError::io("set_read_timeout", e))
}

fn finish(
    ctx: &Arc<Ctx>,
    cq: &Arc<CqInner>,
    link: Link,
    qp_num: u32,
    ring: Weak<RegionInner>,
    peer: Hello,
    accepted: Option<(Hello, Option<String>)>,
) -> Result<Connected<SoftQp>, FabricError> {
    // Server side: the hello to send once established, and who the peer is.
    let (pending_hello, identity) = accepted.map_or((None, None), |(h, id)| (Some(h), id));
    let Link { stream, tls, .. } = link;
    stream
        .set_read_timeout(None)
        .map_err(|e| FabricError::io("set_read_timeout", e))?;
    bootstrap::set_keepalive(&stream)?;
    stream
        .set_nonblocking(true)
        .map_err(|e| FabricError::io("set_nonblocking", e))?;
    let peer_addr = stream
        .peer_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "?".into());
    let dead = Arc::new(AtomicBool::new(false));
    let lending = Arc::new(Lending::default());
    let conn = Arc::new(TcpConn::new(
        qp_num,
        ring,
        ctx.clone(),
        stream,
        dead.clone(),
        lending.clone(),
        tls,
        peer.ring.len,
    ));
    let key = cq.io()?.register(conn.clone())?;
    Ok(Connected {
        qp: SoftQp {
            qp_num,
            lending,
            cq: cq.clone(),
            dead,
            wire: Wire::Tcp(TcpWire {
                conn,
                key,
                cq: cq.clone(),
                pending_hello,
            }),
        },
        peer: peer.ring,
        peer_addr,
        identity,
        fabric: "tcp",
    })
}

impl TcpWire {
    pub(crate) fn established(&mut self) -> Result<(), FabricError> {
        if let Some(hello) = self.pending_hello.take() {
            let bytes = hello.encode();
            self.conn.send(&[IoSlice::new(&bytes)], &[]).map_err(|()| {
                FabricError::unreachable("accept", "the connection failed during the handshake")
            })?;
        }
        Ok(())
    }
}
