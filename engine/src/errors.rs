//! How an error is written down: one line with every cause, for logs,
//! Events and HTTP answers alike.

/// An error and its causes on one line, for logs and HTTP answers.
pub fn error_chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut message = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        message.push_str(": ");
        message.push_str(&cause.to_string());
        source = cause.source();
    }
    message
}
