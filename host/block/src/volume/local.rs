//! The in-process link: a replica held by this process's own [`ReplicaNode`] (the node plugin
//! that runs the volume's engine also serves its local replica) is reached by running the
//! engine's frames against the node directly, under the same session rules and through the same
//! request code as the TCP server (`replica::session`). No socket, no encoding, no copies of
//! the payload and no thread wakeups. The driver takes each frame in the engine's order while
//! it holds its lock (`LocalLink::take`); a small write or a cached read then runs on that same
//! thread right after it lets go (`LocalJob::run`), so several threads' requests run in
//! parallel, and its reply is queued for the driver like a new request. Everything that may
//! wait for the disk (a flush, a read the page cache lacks, large I/O, snapshots) runs on the
//! blocking pool and answers through the driver's event queue, like a socket's reader.
//!
//! `Hello` opens the session inline, which fsyncs the header once (the dirty flag): it happens
//! only when a replica (re)connects, like the driver's own state persists.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use tokio::sync::mpsc;

use super::event::ConnEvent;
use crate::engine::ReplicaId;
use crate::protocol::{DEFAULT_MAX_PAYLOAD, Frame, Message};
use crate::replica::session::{self, Placement};
use crate::replica::{Replica, ReplicaNode};

/// This process's own replica node and the address its server is reached at (how the control
/// plane names it): a replica on it is served in-process ([`super::ReplicaEndpoint::InProcess`],
/// see the module docs).
#[derive(Debug, Clone)]
pub struct InProcessNode {
    pub addr: SocketAddr,
    pub node: Arc<ReplicaNode>,
}

/// The link to one replica on the in-process node.
pub(super) struct LocalLink {
    node: Arc<ReplicaNode>,
    /// Set once `Hello` opened the session.
    session: Option<Arc<LocalSession>>,
    /// The replica's span (volume and replica), which requests run on the blocking pool enter.
    span: tracing::Span,
}

/// One engine session on an in-process replica; ends when the link and every request still
/// running on the blocking pool let go of it.
struct LocalSession {
    replica: Arc<Replica>,
    /// The session's claimed epoch (the fence), as the server keeps it per connection.
    rules: session::Session,
    /// Mutations still running on the blocking pool: a flush does not cover them.
    mutations: AtomicUsize,
    /// Whether the session, if it ended now, ended cleanly: its last request was a flush with no
    /// mutation still running, and the link was not reset.
    clean: AtomicBool,
    /// The link's span: what runs on the blocking pool logs in the volume's name.
    span: tracing::Span,
}

impl Drop for LocalSession {
    fn drop(&mut self) {
        session::end(&self.replica, self.clean.load(Ordering::SeqCst));
    }
}

/// What the link made of one frame.
pub(super) enum Taken {
    /// Answered at once (`Hello`).
    Answered(Frame),
    /// A request to run once the driver is released (see [`LocalJob::run`]).
    Job(LocalJob),
}

/// One request for an in-process replica, taken off the engine under the driver's lock and run
/// after it is released, so requests of several threads run in parallel.
pub(super) struct LocalJob {
    session: Arc<LocalSession>,
    frame: Frame,
    mutation: bool,
    replica: ReplicaId,
    generation: u64,
}

impl LocalJob {
    /// Runs the request on this thread when it costs microseconds (a small write, a read the
    /// page cache holds) and returns its reply; anything that may wait for the disk goes to the
    /// blocking pool, which reports through `events` like a socket's reader.
    pub(super) fn run<L: Send + 'static>(
        self,
        events: &mpsc::UnboundedSender<ConnEvent<L>>,
        runtime: &tokio::runtime::Handle,
    ) -> Option<ConnEvent<L>> {
        let LocalJob { session: s, frame, mutation, replica, generation } = self;
        let request_id = frame.request_id;
        let message = match session::place(&s.replica, &frame.message) {
            Placement::Answered(message) => message,
            Placement::Inline => session::execute(&s.replica, &s.rules, frame.message, DEFAULT_MAX_PAYLOAD),
            Placement::SmallRead | Placement::Blocking => {
                let events = events.clone();
                runtime.spawn_blocking(move || {
                    let _span = s.span.enter();
                    let message = session::execute(&s.replica, &s.rules, frame.message, DEFAULT_MAX_PAYLOAD);
                    s.finished(mutation);
                    // The driver drops it if the link is gone by now, like bytes of a closed
                    // socket.
                    let frame = Frame { request_id, message };
                    let _ = events.send(ConnEvent::Answered { replica, generation, frame });
                });
                return None;
            }
        };
        s.finished(mutation);
        Some(ConnEvent::Answered { replica, generation, frame: Frame { request_id, message } })
    }
}

impl LocalSession {
    fn finished(&self, mutation: bool) {
        if mutation {
            self.mutations.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl LocalLink {
    /// A link to `node` whose requests log in `span`.
    pub(super) fn new(node: Arc<ReplicaNode>, span: tracing::Span) -> Self {
        Self { node, session: None, span }
    }

    /// Takes one frame of the engine (under the driver's lock, in the engine's order); an error
    /// for a frame no engine sends, which ends the link like a protocol error ends a connection.
    pub(super) fn take(&mut self, frame: Frame, replica: ReplicaId, generation: u64) -> Result<Taken, &'static str> {
        let request_id = frame.request_id;
        if let Message::Hello { volume_id, protocol_version, .. } = frame.message {
            if self.session.is_some() {
                return Err("a second Hello on one session");
            }
            let (replica, status, header) = session::open(&self.node, volume_id, protocol_version, None);
            self.session = replica.map(|replica| {
                Arc::new(LocalSession {
                    replica,
                    rules: session::Session::default(),
                    mutations: AtomicUsize::new(0),
                    clean: AtomicBool::new(false),
                    span: self.span.clone(),
                })
            });
            return Ok(Taken::Answered(Frame { request_id, message: Message::HelloReply { status, header } }));
        }
        let Some(s) = &self.session else { return Err("a request before Hello") };
        let Some(mutation) = session::classify(&frame.message) else { return Err("not a request") };
        // Decided in the engine's order, as the server decides it in the order it reads.
        let flush = matches!(frame.message, Message::Flush);
        s.clean.store(flush && s.mutations.load(Ordering::SeqCst) == 0, Ordering::SeqCst);
        if mutation {
            s.mutations.fetch_add(1, Ordering::SeqCst);
        }
        Ok(Taken::Job(LocalJob { session: s.clone(), frame, mutation, replica, generation }))
    }

    /// Ends the link after a failure: the session does not end cleanly, whatever it did last.
    pub(super) fn reset(self) {
        if let Some(s) = &self.session {
            s.clean.store(false, Ordering::SeqCst);
        }
    }
}
