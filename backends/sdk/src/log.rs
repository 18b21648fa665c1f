//! `log`: structured lines into the host's tracing (rate-limited there, secret-named fields
//! redacted). [`Log`] is the capability, [`LogImport`] the component's import of it.
use crate::wit::wasmcsi::backend::log as wit;

pub use wit::Level;

/// The `log` capability. Never fails.
pub trait Log {
    /// One line with structured fields.
    fn log(&self, level: Level, message: &str, fields: &[(&str, &str)]);

    fn debug(&self, message: &str, fields: &[(&str, &str)]) {
        self.log(Level::Debug, message, fields)
    }
    fn info(&self, message: &str, fields: &[(&str, &str)]) {
        self.log(Level::Info, message, fields)
    }
    fn warn(&self, message: &str, fields: &[(&str, &str)]) {
        self.log(Level::Warn, message, fields)
    }
    fn error(&self, message: &str, fields: &[(&str, &str)]) {
        self.log(Level::Error, message, fields)
    }
}

/// The component's `log` import.
#[derive(Debug, Clone, Copy, Default)]
pub struct LogImport;

impl Log for LogImport {
    fn log(&self, level: Level, message: &str, fields: &[(&str, &str)]) {
        let fields: Vec<(String, String)> = fields.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        wit::log(level, message, &fields)
    }
}
