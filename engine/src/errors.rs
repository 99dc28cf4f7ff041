//! How an error is written down: one line with every cause, for logs,
//! Events and HTTP answers alike. Every log line that carries an error
//! carries it as `err = %chain(&err)`.
use std::error::Error;
use std::fmt;

/// An error and its causes, displayed on one line: `what: why: …`.
pub struct Chain<'a, E: ?Sized>(&'a E);

/// `err` and its causes, for a log field (`err = %chain(&err)`).
pub fn chain<E: Error + ?Sized>(err: &E) -> Chain<'_, E> {
    Chain(err)
}

impl<E: Error + ?Sized> fmt::Display for Chain<'_, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(cause) = source {
            write!(f, ": {cause}")?;
            source = cause.source();
        }
        Ok(())
    }
}

/// An error and its causes on one line, for Events and HTTP answers.
pub fn error_chain<E: Error + ?Sized>(err: &E) -> String {
    chain(err).to_string()
}

#[cfg(test)]
mod tests {
    use std::io;

    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("cannot read the state file")]
    struct ReadState(#[source] io::Error);

    #[test]
    fn every_cause_is_on_the_line() {
        let err = ReadState(io::Error::other("disk on fire"));
        assert_eq!(chain(&err).to_string(), "cannot read the state file: disk on fire");
        assert_eq!(error_chain(&err), chain(&err).to_string());
    }
}
