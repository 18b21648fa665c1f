//! The report of a check run: named checks, each passed, failed (with why) or skipped (with
//! why), rendered one line per check and a summary line:
//!
//! ```text
//! PASS create-volume creates a volume
//! FAIL get-volume returns the volume: not-found: volume v1 not found
//! SKIP get-capacity answers: the backend does not list feature get-capacity
//! 1 passed, 1 failed, 1 skipped
//! ```
//!
//! The composed test's checks (`wasmcsi-testkit-checks`, a wasm32 guest) print it; it is the
//! format of `wasmcsi backend check`'s conformance report, kept free of dependencies so that
//! a guest can link it. It runs no check itself.
#![forbid(unsafe_code)]

/// The longest reason a line carries: what a backend answered can be megabytes.
pub const MAX_REASON_BYTES: usize = 400;

/// `why`, cut to [`MAX_REASON_BYTES`] at a character boundary, saying how long it was.
pub fn bounded(why: String) -> String {
    if why.len() <= MAX_REASON_BYTES {
        return why;
    }
    let mut end = MAX_REASON_BYTES;
    while !why.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes in all)", &why[..end], why.len())
}

/// How one check ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Pass,
    Fail(String),
    Skip(String),
}

/// One named check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    pub name: String,
    pub outcome: Outcome,
}

/// Every check of a run, in order.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub checks: Vec<Check>,
}

impl Report {
    /// Record a check; its reason is [`bounded`].
    pub fn record(&mut self, name: &str, outcome: Outcome) {
        let outcome = match outcome {
            Outcome::Pass => Outcome::Pass,
            Outcome::Fail(why) => Outcome::Fail(bounded(why)),
            Outcome::Skip(why) => Outcome::Skip(bounded(why)),
        };
        self.checks.push(Check { name: name.to_owned(), outcome });
    }

    /// Record a pass (`Ok`) or a failure with its reason.
    pub fn judge(&mut self, name: &str, verdict: Result<(), String>) -> bool {
        let passed = verdict.is_ok();
        self.record(name, verdict.map_or_else(Outcome::Fail, |()| Outcome::Pass));
        passed
    }

    /// No check failed.
    pub fn passed(&self) -> bool {
        !self.checks.iter().any(|c| matches!(c.outcome, Outcome::Fail(_)))
    }

    /// (passed, failed, skipped)
    pub fn counts(&self) -> (usize, usize, usize) {
        self.checks.iter().fold((0, 0, 0), |(p, f, s), c| match c.outcome {
            Outcome::Pass => (p + 1, f, s),
            Outcome::Fail(_) => (p, f + 1, s),
            Outcome::Skip(_) => (p, f, s + 1),
        })
    }

    /// The outcome of the check called `name`.
    pub fn outcome(&self, name: &str) -> Option<&Outcome> {
        self.checks.iter().find(|c| c.name == name).map(|c| &c.outcome)
    }

    /// One line per check, then a summary line.
    pub fn render(&self) -> String {
        let mut out = String::new();
        for c in &self.checks {
            let line = match &c.outcome {
                Outcome::Pass => format!("PASS {}\n", c.name),
                Outcome::Fail(why) => format!("FAIL {}: {why}\n", c.name),
                Outcome::Skip(why) => format!("SKIP {}: {why}\n", c.name),
            };
            out.push_str(&line);
        }
        let (p, f, s) = self.counts();
        out.push_str(&format!("{p} passed, {f} failed, {s} skipped\n"));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_one_line_per_check_and_a_summary() {
        let mut r = Report::default();
        assert!(r.judge("a", Ok(())));
        assert!(!r.judge("b", Err("why".into())));
        r.record("c", Outcome::Skip("not offered".into()));
        assert_eq!(r.render(), "PASS a\nFAIL b: why\nSKIP c: not offered\n1 passed, 1 failed, 1 skipped\n");
        assert!(!r.passed());
        assert_eq!(r.outcome("c"), Some(&Outcome::Skip("not offered".into())));
    }

    #[test]
    fn a_long_reason_is_cut_at_a_character_boundary() {
        let mut r = Report::default();
        r.record("huge", Outcome::Fail("é".repeat(1 << 20)));
        let Some(Outcome::Fail(why)) = r.outcome("huge") else { panic!("not recorded") };
        assert!(why.len() < MAX_REASON_BYTES + 40, "{} bytes", why.len());
        assert!(why.ends_with("(2097152 bytes in all)"), "{why}");
        assert_eq!(bounded("short".into()), "short");
    }

    #[test]
    fn passes_with_skips_and_without_checks() {
        let mut r = Report::default();
        assert!(r.passed());
        r.record("c", Outcome::Skip("x".into()));
        assert!(r.passed());
        assert_eq!(r.counts(), (0, 0, 1));
    }
}
