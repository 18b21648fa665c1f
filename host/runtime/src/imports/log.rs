//! `log`: guest log lines into the host's tracing, tagged with the backend, redacted, and
//! paid for out of the call's [`LogBudget`], so a chatty or hostile guest cannot flood the
//! node's logs: however it calls `log`, with whatever field names, counts and sizes, one call
//! makes the host write at most [`BYTES_PER_CALL`] bytes of guest text.
//!
//! Its host functions see a [`LogCtxView`]: the backend's name and the call's budget, nothing
//! else of the call (as wasmtime's `WasiCtxView` gives WASI its context and table).
use crate::bindings::wasmcsi::backend::log::{self as wit, Host, Level};
use crate::call_error::{MAX_ERROR_MESSAGE, clip};
use wasmtime::component::{HasData, LinkerInstance};

/// Everything one backend call can make the host write: its log lines (message, field names
/// and values) and, when it fails, its error message (see [`ERROR_RESERVE`]).
pub const BYTES_PER_CALL: usize = 16 << 10;
/// Of [`BYTES_PER_CALL`], what is kept for the error message the host logs when the call
/// fails (and hands the CO): the longest error message a backend can return.
pub const ERROR_RESERVE: usize = MAX_ERROR_MESSAGE;
/// Lines one call may log, however short.
pub const LINES_PER_CALL: u32 = 64;
/// Longest message of one line.
const MAX_MESSAGE: usize = 2048;
/// Fields of one line kept; the rest are counted.
const MAX_FIELDS: usize = 16;
/// Longest field name and value kept.
const MAX_FIELD_NAME: usize = 64;
const MAX_FIELD_VALUE: usize = 1024;

/// What the guest may still make the host log in this call.
#[derive(Debug)]
pub struct LogBudget {
    bytes: usize,
    lines: u32,
    muted: bool,
}

impl Default for LogBudget {
    fn default() -> Self {
        Self { bytes: BYTES_PER_CALL - ERROR_RESERVE, lines: LINES_PER_CALL, muted: false }
    }
}

/// Field names whose values never reach the logs.
fn is_secret_field(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    ["secret", "password", "token", "key", "credential"].iter().any(|s| n.contains(s))
}

/// One guest line as the host writes it: the message and `name=value` fields, each clipped,
/// at most [`MAX_FIELDS`] fields (the rest counted), secret-like values redacted.
fn render(message: &str, fields: &[(String, String)]) -> (String, String) {
    let mut out = String::new();
    for (k, v) in fields.iter().take(MAX_FIELDS) {
        if !out.is_empty() {
            out.push(' ');
        }
        out.push_str(clip(k, MAX_FIELD_NAME));
        out.push('=');
        out.push_str(if is_secret_field(k) { "<redacted>" } else { clip(v, MAX_FIELD_VALUE) });
    }
    if fields.len() > MAX_FIELDS {
        out.push_str(&format!(" (+{} fields dropped)", fields.len() - MAX_FIELDS));
    }
    (clip(message, MAX_MESSAGE).to_string(), out)
}

impl LogBudget {
    /// Pay for a line: `None` when the budget is spent (the line is dropped), else the line
    /// clipped to what is left.
    fn spend(&mut self, message: &str, fields: &[(String, String)]) -> Option<(String, String)> {
        if self.lines == 0 || self.bytes == 0 {
            return None;
        }
        let (mut message, mut fields) = render(message, fields);
        if message.len() > self.bytes {
            message = clip(&message, self.bytes).to_string();
        }
        let left = self.bytes - message.len();
        if fields.len() > left {
            fields = clip(&fields, left).to_string();
        }
        self.bytes -= message.len() + fields.len();
        self.lines -= 1;
        Some((message, fields))
    }

    /// True once, the first time the budget is found spent.
    fn mute(&mut self) -> bool {
        let first = (self.lines == 0 || self.bytes == 0) && !self.muted;
        self.muted |= first;
        first
    }
}

/// What `log` sees of a call.
pub struct LogCtxView<'a> {
    /// the backend whose lines these are
    pub backend: &'a str,
    /// what the call may still log
    pub budget: &'a mut LogBudget,
}

/// A store whose calls can log: it lends `log` its view.
pub trait LogView: Send {
    fn log(&mut self) -> LogCtxView<'_>;
}

/// `log` for the linker: its host functions get a [`LogCtxView`].
pub struct Log;

impl HasData for Log {
    type Data<'a> = LogCtxView<'a>;
}

/// Link `log`'s host functions into `instance` (named as the component's contract version
/// names the interface).
pub fn add_to_instance<T: LogView + 'static>(instance: &mut LinkerInstance<'_, T>) -> wasmtime::Result<()> {
    wit::add_to_linker_instance::<T, Log>(instance, T::log)
}

impl Host for LogCtxView<'_> {
    async fn log(&mut self, level: Level, message: String, fields: Vec<(String, String)>) {
        let backend = self.backend;
        if let Some((message, fields)) = self.budget.spend(&message, &fields) {
            match level {
                Level::Trace => tracing::trace!(target: "wasmcsi::guest", backend, fields, "{message}"),
                Level::Debug => tracing::debug!(target: "wasmcsi::guest", backend, fields, "{message}"),
                Level::Info => tracing::info!(target: "wasmcsi::guest", backend, fields, "{message}"),
                Level::Warn => tracing::warn!(target: "wasmcsi::guest", backend, fields, "{message}"),
                Level::Error => tracing::error!(target: "wasmcsi::guest", backend, fields, "{message}"),
            }
        }
        if self.budget.mute() {
            tracing::warn!(
                target: "wasmcsi::guest",
                backend,
                "log budget of {LINES_PER_CALL} lines / {BYTES_PER_CALL} bytes per call used up; muting"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_like_fields_are_recognised() {
        assert!(is_secret_field("userKey"));
        assert!(is_secret_field("csi.storage.k8s.io/provisioner-secret-name"));
        assert!(!is_secret_field("volume"));
    }

    #[test]
    fn field_names_counts_and_sizes_are_clipped_and_paid_for() {
        let mut b = LogBudget::default();
        let (huge, long) = ("m".repeat(1 << 20), "n".repeat(4096));
        let fields: Vec<(String, String)> = (0..10_000).map(|i| (format!("{long}{i}"), "v".into())).collect();
        let (m, f) = b.spend(&huge, &fields).expect("first line");
        assert_eq!(m.len(), MAX_MESSAGE);
        assert_eq!(f.len(), MAX_FIELDS * (MAX_FIELD_NAME + 3) - 1 + " (+9984 fields dropped)".len(), "{f}");
        assert!(f.ends_with(" (+9984 fields dropped)"), "{f}");
        let fields: Vec<(String, String)> = (0..10_000).map(|i| (format!("{long}{i}"), long.clone())).collect();
        let mut total = m.len() + f.len();
        while let Some((m, f)) = b.spend(&huge, &fields) {
            total += m.len() + f.len();
        }
        assert_eq!(total, BYTES_PER_CALL - ERROR_RESERVE, "the whole budget and not a byte more");
        assert!(b.mute() && !b.mute(), "muted once");
    }
}
