//! Where every program of the project logs: stderr, as text or JSON lines,
//! filtered in tracing's env-filter syntax.

/// Installs the process's log subscriber.
pub fn init(json: bool, filter: &str) {
    let builder = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_writer(std::io::stderr);
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
}
