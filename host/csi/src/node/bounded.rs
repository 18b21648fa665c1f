//! Blocking calls that may never return: a filesystem call on a dead NFS server or on a FUSE
//! file whose daemon is stuck blocks in the kernel and cannot be cancelled. They run on their
//! own thread, and the caller waits a bounded time for the answer; on a timeout the thread is
//! left behind (it ends when the kernel lets go: the server answers, the mount is forced off,
//! the FUSE connection is aborted), and the caller escalates.
use std::sync::mpsc;
use std::time::Duration;

/// A call running on its own thread; its answer can be waited for more than once (wait, act,
/// wait again).
pub struct Pending<T>(mpsc::Receiver<T>);

impl<T> Pending<T> {
    /// The answer, if it comes within `patience`.
    pub fn wait(&self, patience: Duration) -> Option<T> {
        self.0.recv_timeout(patience).ok()
    }
}

/// Start `f` on its own thread.
pub fn start<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Pending<T> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    Pending(rx)
}

/// Run `f` on its own thread and wait at most `deadline` for it.
pub fn bounded<T: Send + 'static>(deadline: Duration, f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    start(f).wait(deadline)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_in_time_is_returned_and_a_late_one_can_still_be_awaited() {
        assert_eq!(bounded(Duration::from_secs(5), || 7), Some(7));
        let p = start(|| {
            std::thread::sleep(Duration::from_millis(300));
            8
        });
        assert_eq!(p.wait(Duration::from_millis(10)), None, "not yet");
        assert_eq!(p.wait(Duration::from_secs(5)), Some(8), "the same call, awaited again");
    }
}
