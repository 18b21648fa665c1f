//! What a replica's link reports to the driver ([`ConnEvent`]): the TCP connection's tasks
//! (`connection`) and the in-process replica's requests (`local`) report, the driver (`driver`)
//! handles. The events live here, apart from all three, so that neither reporter imports the
//! driver: a `Connected` event hands over the link the driver then writes to, which is the
//! driver's own type `L` (its `Link`: a TCP connection's write side or an in-process link).

use crate::engine::ReplicaId;
use crate::protocol::Frame;

/// What a connection task (or an in-process request) reports, tagged with the connection's
/// generation.
pub(super) enum ConnEvent<L> {
    Connected {
        replica: ReplicaId,
        generation: u64,
        link: L,
    },
    ConnectFailed {
        replica: ReplicaId,
        generation: u64,
        error: String,
    },
    /// Every frame one read of the socket completed, in order.
    Received {
        replica: ReplicaId,
        generation: u64,
        frames: Vec<Frame>,
    },
    /// One reply of an in-process replica, run on the driving thread: a pass mostly runs one,
    /// and a vector for it would be an allocation per I/O.
    Answered {
        replica: ReplicaId,
        generation: u64,
        frame: Frame,
    },
    Closed {
        replica: ReplicaId,
        generation: u64,
        error: String,
    },
}
