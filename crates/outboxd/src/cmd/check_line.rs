//! One line of `outboxd check`'s output, which `admin`, `check_jobs`, `privileges` and `parked`
//! each produce: its own module, so none of them imports another for it.

/// One line of `outboxd check` output.
#[derive(Debug)]
pub struct CheckLine {
    pub ok: bool,
    /// Works, but more exposed than it needs to be (printed as WARN; check still passes).
    pub warn: bool,
    pub what: String,
    pub detail: String,
}

impl CheckLine {
    pub fn ok(what: &str, detail: impl Into<String>) -> Self {
        line(true, what, detail)
    }
    pub fn fail(what: &str, detail: impl Into<String>) -> Self {
        line(false, what, detail)
    }
    pub fn warn(what: &str, detail: impl Into<String>) -> Self {
        Self {
            warn: true,
            ..line(true, what, detail)
        }
    }
}

/// A line that passed (`ok`) or failed, without a warning.
pub fn line(ok: bool, what: &str, detail: impl Into<String>) -> CheckLine {
    CheckLine {
        ok,
        warn: false,
        what: what.into(),
        detail: detail.into(),
    }
}
