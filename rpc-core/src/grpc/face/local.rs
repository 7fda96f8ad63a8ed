//! How a face call reaches the server without a connection: started on
//! the server's routes as a dispatcher starts a request ([`Local`]), its
//! frames passed through two in-process links ([`LocalLink`]) into the
//! same stream state a connection's frames reach, and cancelled on the
//! server when the face lets go of it early ([`FaceOwner`]).

use crate::compression::{Encoding, EncodingSet};
use crate::descriptor::MethodKind;
use crate::dispatch::{Frame, OutFrame};
use crate::protocol::stream::DEFAULT_WINDOW;
use crate::protocol::{CallId, FrameKind, SendError};
use crate::server::{NewCall, Registry, ServerShared};
use crate::streaming::{CallOwner, Link, Outbox, Packed, Pump, StreamCore};
use crate::{Metadata, Peer, RawMessage, Status, Streaming};
use prost::bytes::Bytes;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

/// The server as the face calls it: each gRPC call is started on the
/// server's shared state as a dispatcher starts a request (routes,
/// interceptors, deadline, the blocking pool), with its handler run on the
/// tokio worker that read it. No ring and no dispatcher sit between them:
/// the call's frames pass through two [`LocalLink`]s, one towards each
/// end, into the same stream state (windows,
/// half-close, cancel) that a connection's frames reach.
pub(super) struct Local {
    pub(super) shared: Arc<ServerShared>,
    /// The face's calls that hear from their caller after the request.
    pub(super) registry: Arc<Registry>,
    pub(super) next_id: AtomicU64,
}

/// The face's calls' "queue pair": the face has a registry of its own.
const FACE_QP: u32 = 0;

/// The face's end of a started call: what arrives from the handler, and
/// the link for what the caller sends.
pub(super) struct Started {
    /// A unary answer's trailing metadata (see `To::Face`).
    pub(super) trailers: crate::Trailers,
    core: Arc<StreamCore>,
    link: Arc<dyn Link>,
    call_id: CallId,
    owner: Arc<dyn CallOwner>,
}

impl Started {
    /// The stream of what the handler sends; `pump` sends the caller's
    /// request stream.
    /// Its messages come as the handler sent them, compressed or not: the
    /// face passes them on so.
    pub(super) fn stream(self, pump: Option<Box<dyn Pump>>) -> Streaming<RawMessage> {
        Streaming::new(self.core, self.link, self.call_id, Some(self.owner), pump).keeping_packed()
    }

    /// The outbox of the caller's request stream.
    pub(super) fn outbox(&self) -> Outbox {
        Outbox::new(self.core.clone(), self.link.clone(), self.call_id, 0, None)
    }
}

impl Local {
    /// Starts a call of the method `method_id` (of `kind`) with the
    /// request `first` (unary and server-streaming calls), as it arrived
    /// (compressed or not: the handler inflates it), for a caller that
    /// takes back what `caller_accepts` names.
    pub(super) fn start(
        self: &Arc<Self>,
        method_id: u32,
        kind: MethodKind,
        head: Head,
        first: Option<Packed>,
        caller_accepts: EncodingSet,
    ) -> Started {
        let call_id = CallId(self.next_id.fetch_add(1, Ordering::Relaxed));
        let core = StreamCore::new(DEFAULT_WINDOW, kind.server_streams());
        let max_message = self.shared.max_message();
        let settled = Arc::new(AtomicBool::new(false));
        let trailers = crate::Trailers::new();
        let to_face: Arc<dyn Link> = Arc::new(LocalLink {
            remote: head.remote.clone(),
            max_message,
            to: To::Face {
                core: core.clone(),
                final_message: !kind.server_streams(),
                settled: settled.clone(),
                trailers: trailers.clone(),
            },
        });
        let timeout_us = crate::protocol::timeout_field(head.timeout);
        let (payload, encoding) = first.map_or((Bytes::new(), None), |m| (m.bytes, m.encoding));
        self.shared.start_call_on_tokio(
            &self.registry,
            NewCall {
                qp_num: FACE_QP,
                call_id,
                method_id,
                timeout_us,
                metadata: Some(head.metadata),
                payload: Vec::from(payload).into(),
                sink: to_face,
                remote: &head.remote,
                kind: None,
                // As a `Request` frame says them: the message's encoding
                // and what the caller takes back.
                flags: encoding.map_or(0, Encoding::flags) | caller_accepts.flags(),
            },
        );
        let owner = Arc::new(FaceOwner {
            local: self.clone(),
            core: core.clone(),
            settled,
        });
        // gRPC leaves a deadline to the server: a caller (tonic's, say)
        // that set one waits for the status that ends the call by it. A
        // call still under way then is failed `DeadlineExceeded` and its
        // handler cancelled, streams included.
        if let Some(timeout) = head.timeout {
            let owner = Arc::downgrade(&owner);
            tokio::spawn(async move {
                tokio::time::sleep(timeout).await;
                if let Some(owner) = owner.upgrade() {
                    owner.end(
                        call_id,
                        Status::deadline_exceeded("the call's deadline (grpc-timeout) passed"),
                    );
                }
            });
        }
        Started {
            trailers,
            core,
            link: Arc::new(LocalLink {
                remote: head.remote,
                max_message,
                to: To::Handler(self.clone()),
            }),
            call_id,
            owner,
        }
    }
}

/// A gRPC request's head as ours: its metadata (gRPC's own headers left
/// out), its deadline (`grpc-timeout`) and its caller.
pub(super) struct Head {
    pub(super) metadata: Metadata,
    pub(super) timeout: Option<Duration>,
    pub(super) remote: Arc<Peer>,
}

/// A frame of `out`, as a connection would deliver it: its payload
/// written by `fill`, checked against `max` bytes.
fn frame_of(
    out: &OutFrame<'_>,
    max: usize,
    fill: &mut dyn FnMut(&mut [u8]),
) -> Result<Frame, SendError> {
    let header = out.header(max)?;
    let mut payload = vec![0; out.payload_len];
    fill(&mut payload);
    Ok(Frame {
        header,
        metadata: Some(out.metadata.cloned().unwrap_or_default()),
        payload: payload.into(),
    })
}

/// One end of a face call's in-process link: what would be a connection.
struct LocalLink {
    remote: Arc<Peer>,
    max_message: usize,
    to: To,
}

/// Where a [`LocalLink`]'s frames go.
enum To {
    /// What the handler sends, to the face's end of the call: as a
    /// client's dispatcher applies a server's frames to a stream. With
    /// `final_message`, the response is one message, in the final frame
    /// (unary and client-streaming calls).
    Face {
        core: Arc<StreamCore>,
        final_message: bool,
        /// Set once the handler's end came (or the face cancelled it).
        settled: Arc<AtomicBool>,
        /// A unary response's trailing metadata, kept apart from its
        /// headers for gRPC's trailers ([`Link::keep_trailers_apart`]).
        trailers: crate::Trailers,
    },
    /// What the caller sends after its request (stream messages,
    /// half-close, window), to the server's end of the call: as a
    /// server's dispatcher applies a client's frames.
    Handler(Arc<Local>),
}

impl LocalLink {
    /// Applies a handler's frame to the face's end of the call.
    fn to_face(core: &StreamCore, final_message: bool, frame: Frame) -> Result<(), SendError> {
        let h = frame.header;
        let applied = match h.kind {
            FrameKind::Message => {
                core.on_message(&h, frame.payload, frame.metadata.unwrap_or_default())
            }
            FrameKind::Window => core.on_grant(h.timeout_us),
            FrameKind::Response => {
                let last = final_message.then_some((frame.payload, h.flags));
                core.on_end(Ok(()), last, frame.metadata, true)
            }
            FrameKind::Error => {
                let status = frame.error_status();
                core.on_end(Err(status), None, frame.metadata, true)
            }
            kind => {
                return Err(SendError::Closed(format!(
                    "a handler sent a {kind:?} frame to the gRPC face"
                )));
            }
        };
        applied.map_err(|e| {
            let why = format!("stream protocol violation: {e}");
            core.fail(Status::internal(why.clone()));
            SendError::Closed(why)
        })
    }
}

impl Link for LocalLink {
    fn send(
        &self,
        out: &OutFrame<'_>,
        _cork: bool,
        fill: &mut dyn FnMut(&mut [u8]),
    ) -> Result<(), SendError> {
        if let To::Face { core, .. } = &self.to {
            if core.is_over() {
                return Err(SendError::Closed("the gRPC caller went away".into()));
            }
        }
        let frame = frame_of(out, self.max_message, fill)?;
        match &self.to {
            To::Face {
                core,
                final_message,
                settled,
                ..
            } => {
                if matches!(frame.header.kind, FrameKind::Response | FrameKind::Error) {
                    settled.store(true, Ordering::Release);
                }
                LocalLink::to_face(core, *final_message, frame)
            }
            To::Handler(local) => local
                .registry
                .on_call_frame(FACE_QP, frame)
                .map_err(SendError::Closed),
        }
    }

    fn uncork(&self) {}

    fn peer(&self) -> &str {
        &self.remote.addr
    }

    fn max_message(&self) -> usize {
        self.max_message
    }

    fn remote(&self) -> Option<Arc<Peer>> {
        Some(self.remote.clone())
    }

    fn recycle(&self, _: crate::payload::Payload) {}

    fn keep_trailers_apart(&self, trailers: &Metadata) -> bool {
        match &self.to {
            To::Face { trailers: kept, .. } => {
                kept.insert_all(trailers);
                true
            }
            To::Handler(_) => false,
        }
    }
}

/// Cancels a call the face lets go of before it ended (the caller reset
/// its HTTP/2 stream, or its deadline passed).
struct FaceOwner {
    local: Arc<Local>,
    core: Arc<StreamCore>,
    /// The handler's end came, or it was cancelled: nothing to cancel.
    settled: Arc<AtomicBool>,
}

impl FaceOwner {
    /// Ends a call not yet over with `status` (the face's caller sees it)
    /// and cancels its handler, unless it ended. (The face's end of the
    /// call may have failed on its own, for a caller's message that broke
    /// gRPC's framing: its handler is cancelled all the same.)
    fn end(&self, call_id: CallId, status: Status) {
        if self.core.end_code().is_none() {
            self.core.fail(status);
        }
        if self.settled.swap(true, Ordering::AcqRel) {
            return;
        }
        let cancel = OutFrame {
            kind: FrameKind::Cancel,
            flags: 0,
            call_id,
            method_id: 0,
            status: 0,
            timeout_us: 0,
            metadata: None,
            payload_len: 0,
        };
        let sent = frame_of(&cancel, usize::MAX, &mut |_| {})
            .map_err(|e| Status::from(e).message().to_owned())
            .and_then(|frame| self.local.registry.on_call_frame(FACE_QP, frame));
        if let Err(why) = sent {
            tracing::debug!(%why, "could not cancel a call of the gRPC face");
        }
    }
}

impl CallOwner for FaceOwner {
    fn release(&self, call_id: CallId) {
        self.end(
            call_id,
            Status::cancelled("the gRPC caller cancelled the call"),
        );
    }

    fn progress(&self) -> bool {
        false
    }

    fn ensure_polled(&self) {}
}
