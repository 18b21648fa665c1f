//! The fake `log`: every line kept, for assertions.
use crate::log::{Level, Log};
use std::cell::RefCell;

/// One logged line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogLine {
    pub level: Level,
    pub message: String,
    pub fields: Vec<(String, String)>,
}

impl LogLine {
    /// A field's value.
    pub fn field(&self, key: &str) -> Option<&str> {
        self.fields.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }
}

#[derive(Debug, Default)]
pub struct FakeLog {
    lines: RefCell<Vec<LogLine>>,
}

impl FakeLog {
    pub fn lines(&self) -> Vec<LogLine> {
        self.lines.borrow().clone()
    }
    /// The messages, in order.
    pub fn messages(&self) -> Vec<String> {
        self.lines.borrow().iter().map(|l| l.message.clone()).collect()
    }
}

impl Log for FakeLog {
    fn log(&self, level: Level, message: &str, fields: &[(&str, &str)]) {
        let fields = fields.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        self.lines.borrow_mut().push(LogLine { level, message: message.to_owned(), fields });
    }
}
