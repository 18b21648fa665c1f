//! What an `accept` error means, and how long to wait after one.
//!
//! Running out of descriptors or kernel memory (EMFILE, ENFILE, ENOBUFS, ENOMEM) leaves the
//! pending connection in the backlog, so the listener stays readable and a loop that retries at
//! once spins at 100% CPU until something else closes a descriptor: those back off
//! exponentially, from [`FIRST_DELAY`] to [`MAX_DELAY`], and a burst of them is logged once. An
//! error that belongs to the one connection being accepted (it was reset before `accept`, and the
//! others accept(2) lists as "treat like EAGAIN") is retried at once. An error that means the
//! listening socket itself is unusable ends the loop.

use std::io;
use std::time::Duration;

pub const FIRST_DELAY: Duration = Duration::from_millis(5);
pub const MAX_DELAY: Duration = Duration::from_secs(1);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AcceptError {
    /// Out of descriptors or memory: wait, then retry.
    Exhausted,
    /// The accepted connection's own error: retry at once.
    Connection,
    /// The listening socket is unusable: stop.
    Fatal,
}

pub(crate) fn classify(e: &io::Error) -> AcceptError {
    match e.raw_os_error() {
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM) => AcceptError::Exhausted,
        Some(libc::EBADF | libc::EINVAL | libc::ENOTSOCK | libc::EFAULT) => AcceptError::Fatal,
        _ => AcceptError::Connection,
    }
}

/// Exponential delays for one burst of exhaustion errors.
#[derive(Debug, Default)]
pub(crate) struct Backoff {
    /// Errors in the current burst (0: not in one).
    errors: u64,
    next: Option<Duration>,
}

impl Backoff {
    /// The delay before the next retry, and whether this error starts a burst (log it).
    pub(crate) fn on_error(&mut self) -> (Duration, bool) {
        let delay = self.next.unwrap_or(FIRST_DELAY);
        self.next = Some((delay * 2).min(MAX_DELAY));
        self.errors += 1;
        (delay, self.errors == 1)
    }

    /// An accept succeeded: the burst (if any) is over; returns how many errors it had.
    pub(crate) fn on_success(&mut self) -> u64 {
        self.next = None;
        std::mem::take(&mut self.errors)
    }
}

/// The back-off of [`super::Listener`]'s loop for an accept loop it does not run (the CSI unix
/// socket, served by tonic): call [`Self::after_error`] with each failed `accept` and sleep for
/// what it says, [`Self::after_success`] with each accepted connection.
#[derive(Debug)]
pub struct AcceptBackoff {
    /// Names the listener in the log lines.
    listener: String,
    backoff: Backoff,
}

impl AcceptBackoff {
    pub fn new(listener: impl Into<String>) -> Self {
        AcceptBackoff { listener: listener.into(), backoff: Backoff::default() }
    }

    /// How long to wait before the next `accept` (zero after the one connection's own error),
    /// or the error back when the listening socket is unusable. The first exhaustion error of a
    /// burst is logged.
    pub fn after_error(&mut self, error: io::Error) -> Result<Duration, io::Error> {
        match classify(&error) {
            AcceptError::Connection => Ok(Duration::ZERO),
            AcceptError::Fatal => Err(error),
            AcceptError::Exhausted => {
                let (delay, burst_starts) = self.backoff.on_error();
                if burst_starts {
                    tracing::warn!(
                        listener = %self.listener,
                        %error,
                        "accept failed: out of descriptors or memory; backing off (up to {MAX_DELAY:?}) until it succeeds"
                    );
                }
                Ok(delay)
            }
        }
    }

    /// A connection was accepted: the end of a burst of errors is logged.
    pub fn after_success(&mut self) {
        let errors = self.backoff.on_success();
        if errors > 0 {
            tracing::info!(listener = %self.listener, errors, "accepting again after running out of resources");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_double_up_to_a_second_and_a_burst_logs_once() {
        let mut b = Backoff::default();
        let mut delays = Vec::new();
        let mut starts = 0;
        for _ in 0..12 {
            let (d, start) = b.on_error();
            delays.push(d);
            starts += usize::from(start);
        }
        assert_eq!(starts, 1);
        assert_eq!(delays[0], FIRST_DELAY);
        assert_eq!(delays[1], FIRST_DELAY * 2);
        assert_eq!(*delays.last().expect("delays"), MAX_DELAY);
        assert!(delays.windows(2).all(|w| w[1] >= w[0]));
        assert_eq!(b.on_success(), 12);
        assert_eq!(b.on_error(), (FIRST_DELAY, true));
    }

    #[test]
    fn errors_are_classified_by_errno() {
        for errno in [libc::EMFILE, libc::ENFILE, libc::ENOBUFS, libc::ENOMEM] {
            assert_eq!(classify(&io::Error::from_raw_os_error(errno)), AcceptError::Exhausted);
        }
        assert_eq!(classify(&io::Error::from_raw_os_error(libc::ECONNABORTED)), AcceptError::Connection);
        assert_eq!(classify(&io::Error::from_raw_os_error(libc::EPROTO)), AcceptError::Connection);
        assert_eq!(classify(&io::Error::from_raw_os_error(libc::EBADF)), AcceptError::Fatal);
    }

    #[test]
    fn the_public_back_off_waits_on_exhaustion_only_and_gives_fatal_errors_back() {
        let mut b = AcceptBackoff::new("test");
        let emfile = || io::Error::from_raw_os_error(libc::EMFILE);
        assert_eq!(b.after_error(emfile()).expect("wait"), FIRST_DELAY);
        assert_eq!(b.after_error(emfile()).expect("wait"), FIRST_DELAY * 2);
        assert_eq!(b.after_error(io::Error::from_raw_os_error(libc::ECONNABORTED)).expect("retry"), Duration::ZERO);
        b.after_success();
        assert_eq!(b.after_error(emfile()).expect("a new burst"), FIRST_DELAY);
        let fatal = b.after_error(io::Error::from_raw_os_error(libc::EBADF)).expect_err("fatal");
        assert_eq!(fatal.raw_os_error(), Some(libc::EBADF));
    }
}
