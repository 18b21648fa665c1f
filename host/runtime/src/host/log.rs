//! `log`: guest log lines into the host's tracing, tagged with the backend, redacted and
//! rate-limited per call so a chatty or hostile guest cannot flood the node's logs.
use crate::bindings::wasmcsi::backend::log::{Host, Level};
use crate::state::CallState;

/// Lines one call may log; the rest are counted and dropped.
pub const LINES_PER_CALL: u32 = 64;
const MAX_LINE: usize = 2048;

/// Field names whose values never reach the logs.
fn is_secret_field(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    ["secret", "password", "token", "key", "credential"].iter().any(|s| n.contains(s))
}

fn clip(s: &str) -> &str {
    if s.len() <= MAX_LINE {
        return s;
    }
    let mut end = MAX_LINE;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

impl Host for CallState {
    async fn log(&mut self, level: Level, message: String, fields: Vec<(String, String)>) {
        if self.log_budget == 0 {
            return;
        }
        self.log_budget -= 1;
        let fields: Vec<String> = fields
            .iter()
            .map(|(k, v)| if is_secret_field(k) { format!("{k}=<redacted>") } else { format!("{k}={}", clip(v)) })
            .collect();
        let (backend, message, fields) = (&self.caps.backend, clip(&message), fields.join(" "));
        match level {
            Level::Trace => tracing::trace!(target: "wasmcsi::guest", backend, fields, "{message}"),
            Level::Debug => tracing::debug!(target: "wasmcsi::guest", backend, fields, "{message}"),
            Level::Info => tracing::info!(target: "wasmcsi::guest", backend, fields, "{message}"),
            Level::Warn => tracing::warn!(target: "wasmcsi::guest", backend, fields, "{message}"),
            Level::Error => tracing::error!(target: "wasmcsi::guest", backend, fields, "{message}"),
        }
        if self.log_budget == 0 {
            tracing::warn!(target: "wasmcsi::guest", backend, "log budget of {LINES_PER_CALL} lines per call used up; muting");
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn secret_like_fields_are_recognised() {
        assert!(super::is_secret_field("userKey"));
        assert!(super::is_secret_field("csi.storage.k8s.io/provisioner-secret-name"));
        assert!(!super::is_secret_field("volume"));
    }
}
