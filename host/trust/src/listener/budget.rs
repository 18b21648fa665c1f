//! The handshake byte budget: a socket wrapper that counts what the server reads and refuses to
//! read past the budget until the handshake is done ([`HandshakeBudget::lift`]).
//!
//! Each read is cut to what is left of the budget, so the server never reads more than the
//! budget from a peer that has not authenticated, however the TLS stack sizes its reads; once
//! the budget is spent the next read fails with [`BudgetExceeded`]. After the handshake the
//! wrapper passes everything through (one branch per read).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// The error a read past the budget fails with (inside an `io::Error` of kind `InvalidData`).
#[derive(Debug, thiserror::Error)]
#[error("the peer sent more than {budget} bytes before completing the TLS handshake")]
pub struct BudgetExceeded {
    pub budget: usize,
}

/// A socket whose reads are bounded until [`Self::lift`].
#[derive(Debug)]
pub struct HandshakeBudget<S = TcpStream> {
    inner: S,
    budget: usize,
    read: usize,
    lifted: bool,
}

impl<S> HandshakeBudget<S> {
    pub fn new(inner: S, budget: usize) -> Self {
        HandshakeBudget { inner, budget, read: 0, lifted: false }
    }

    /// Bytes read so far while bounded.
    pub fn bytes_read(&self) -> usize {
        self.read
    }

    /// Ends the bound (the handshake completed).
    pub fn lift(&mut self) {
        self.lifted = true;
    }

    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    pub fn into_inner(self) -> S {
        self.inner
    }
}

/// Whether an I/O error is the budget's.
pub fn is_budget_exceeded(e: &io::Error) -> bool {
    e.get_ref().is_some_and(|inner| inner.is::<BudgetExceeded>())
}

impl<S: AsyncRead + Unpin> AsyncRead for HandshakeBudget<S> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.lifted {
            return Pin::new(&mut this.inner).poll_read(cx, buf);
        }
        let left = this.budget - this.read;
        if left == 0 {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::InvalidData,
                BudgetExceeded { budget: this.budget },
            )));
        }
        // Read into at most `left` bytes of the caller's buffer. `initialize_unfilled_to` zeroes
        // that much once (handshake-sized, and only before the handshake completes), which keeps
        // this free of unsafe.
        let allowed = left.min(buf.remaining());
        let window = buf.initialize_unfilled_to(allowed);
        let mut limited = ReadBuf::new(window);
        ready!(Pin::new(&mut this.inner).poll_read(cx, &mut limited))?;
        let n = limited.filled().len();
        this.read += n;
        buf.advance(n);
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for HandshakeBudget<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, data)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt as _;

    #[tokio::test]
    async fn reads_stop_at_the_budget_and_resume_when_lifted() {
        let data = [7u8; 100];
        let mut bounded = HandshakeBudget::new(&data[..], 30);
        let mut buf = [0u8; 64];
        let mut total = 0;
        let err = loop {
            match bounded.read(&mut buf).await {
                Ok(n) => total += n,
                Err(e) => break e,
            }
        };
        assert_eq!(total, 30);
        assert_eq!(bounded.bytes_read(), 30);
        assert!(is_budget_exceeded(&err), "{err}");
        bounded.lift();
        let mut rest = Vec::new();
        bounded.read_to_end(&mut rest).await.expect("lifted");
        assert_eq!(rest.len(), 70);
    }
}
