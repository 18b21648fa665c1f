//! Read and write timeouts on an accepted connection ([`Timeouts`]): the idle bound of control
//! and metrics connections.
//!
//! A read that waits longer than the read timeout for a byte fails with `TimedOut`, and so does a
//! write (or flush) that waits longer than the write timeout for the peer to take bytes. The
//! clock of each direction starts when an operation first waits and stops when it makes
//! progress, so a connection that trickles one byte per timeout is still served; what it cannot
//! do is hold a connection (and its permit) while sending or reading nothing. For a server whose
//! protocol always keeps a read pending (HTTP/1 between requests, HTTP/2), the read timeout is
//! the idle timeout.

use std::future::Future as _;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// `S` with read and write timeouts (see the module doc).
#[derive(Debug)]
pub struct Timeouts<S> {
    inner: S,
    read: Clock,
    write: Clock,
}

#[derive(Debug)]
struct Clock {
    timeout: Duration,
    sleep: Pin<Box<Sleep>>,
    /// An operation waits and `sleep` is its deadline.
    running: bool,
}

impl Clock {
    fn new(timeout: Duration) -> Self {
        Clock { timeout, sleep: Box::pin(tokio::time::sleep(timeout)), running: false }
    }

    /// After an operation returned `result`: stop the clock on progress; on waiting, start it if
    /// it is not running and fail once it has run out.
    fn check<T>(&mut self, cx: &mut Context<'_>, result: Poll<io::Result<T>>, what: &str) -> Poll<io::Result<T>> {
        if result.is_ready() {
            self.running = false;
            return result;
        }
        if !self.running {
            self.sleep.as_mut().reset(Instant::now() + self.timeout);
            self.running = true;
        }
        match self.sleep.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("no {what} for {:?}: connection closed", self.timeout),
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<S> Timeouts<S> {
    pub fn new(inner: S, read: Duration, write: Duration) -> Self {
        Timeouts { inner, read: Clock::new(read), write: Clock::new(write) }
    }

    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Timeouts<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let result = Pin::new(&mut this.inner).poll_read(cx, buf);
        this.read.check(cx, result, "byte received")
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Timeouts<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        let result = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.write.check(cx, result, "byte taken by the peer")
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        let result = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.write.check(cx, result, "byte taken by the peer")
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let result = Pin::new(&mut this.inner).poll_flush(cx);
        this.write.check(cx, result, "byte taken by the peer")
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let result = Pin::new(&mut this.inner).poll_shutdown(cx);
        this.write.check(cx, result, "byte taken by the peer")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    const TIMEOUT: Duration = Duration::from_millis(400);

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread().enable_time().build().expect("runtime")
    }

    #[test]
    fn a_silent_peer_times_out_the_read_and_a_trickling_one_does_not() {
        runtime().block_on(async {
            let (ours, mut theirs) = tokio::io::duplex(64);
            let mut conn = Timeouts::new(ours, TIMEOUT, TIMEOUT);
            let mut byte = [0u8; 1];
            // A byte every half timeout: 4 of them span twice the timeout, and all are served.
            let trickle = tokio::spawn(async move {
                for _ in 0..4 {
                    tokio::time::sleep(TIMEOUT / 2).await;
                    theirs.write_all(b"x").await.expect("write");
                }
                theirs
            });
            for _ in 0..4 {
                conn.read_exact(&mut byte).await.expect("a byte within the timeout");
            }
            let _theirs = trickle.await.expect("trickle");
            let started = Instant::now();
            let err = conn.read_exact(&mut byte).await.expect_err("silence");
            assert_eq!(err.kind(), io::ErrorKind::TimedOut);
            assert!(started.elapsed() >= TIMEOUT && started.elapsed() < TIMEOUT * 4, "{:?}", started.elapsed());
        });
    }

    #[test]
    fn a_peer_that_reads_nothing_times_out_the_write() {
        runtime().block_on(async {
            let (ours, _theirs) = tokio::io::duplex(16);
            let mut conn = Timeouts::new(ours, Duration::from_secs(60), TIMEOUT);
            let started = Instant::now();
            let err = conn.write_all(&[0u8; 1024]).await.expect_err("the peer reads nothing");
            assert_eq!(err.kind(), io::ErrorKind::TimedOut);
            assert!(started.elapsed() >= TIMEOUT && started.elapsed() < TIMEOUT * 4, "{:?}", started.elapsed());
        });
    }
}
