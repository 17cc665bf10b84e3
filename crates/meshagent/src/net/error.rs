//! The one formatter of error chains used by every network caller.

/// An error and its causes on one line, "outer: inner: …". hyper's and tonic's own messages
/// name only the stage ("error reading a body from connection", "transport error") and put
/// the reason in their source; a cause whose text the line already holds is not repeated
/// (hyper often repeats its source in its own message).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let m = c.to_string();
        if !m.is_empty() && !out.contains(&m) {
            out.push_str(": ");
            out.push_str(&m);
        }
        cause = c.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::error_chain;

    #[derive(Debug, thiserror::Error)]
    #[error("outer")]
    struct Outer(#[source] Middle);
    #[derive(Debug, thiserror::Error)]
    #[error("middle: inner")]
    struct Middle(#[source] std::io::Error);

    #[test]
    fn causes_once_each() {
        let e = Outer(Middle(std::io::Error::other("inner")));
        assert_eq!(error_chain(&e), "outer: middle: inner");
    }
}
