//! Flag types and parsers that several commands share.
use std::net::SocketAddr;
use std::time::Duration;

use clap::{Args, ValueEnum};

/// `--metrics-addr`: an address, or `off`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Listen(pub(crate) Option<SocketAddr>);

pub(crate) fn parse_listen(text: &str) -> Result<Listen, String> {
    if text == "off" {
        return Ok(Listen(None));
    }
    text.parse()
        .map(|addr| Listen(Some(addr)))
        .map_err(|_| format!("`{text}` is not ADDRESS:PORT (e.g. 0.0.0.0:9809, [::]:9809) or off"))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum OnOff {
    On,
    Off,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum LogFormat {
    Json,
    Text,
}

#[derive(Debug, Args)]
#[command(next_help_heading = "Logging")]
pub(crate) struct LogArgs {
    #[arg(long, value_enum, default_value = "text", env = "FUSE_SUPERVISOR_LOG_FORMAT")]
    pub(crate) log_format: LogFormat,
    /// Filter in tracing's env-filter syntax.
    #[arg(long, default_value = "info", env = "FUSE_SUPERVISOR_LOG")]
    pub(crate) log: String,
}

impl LogArgs {
    /// The flags that give a child process the same log.
    pub(crate) fn flags(&self) -> [String; 4] {
        let format = match self.log_format {
            LogFormat::Json => "json",
            LogFormat::Text => "text",
        };
        ["--log-format".into(), format.into(), "--log".into(), self.log.clone()]
    }

    pub(crate) fn init(&self) {
        fuse_supervisor_engine::logging::init(matches!(self.log_format, LogFormat::Json), &self.log);
    }
}

pub(crate) fn parse_duration(text: &str) -> Result<Duration, String> {
    let (number, unit) = text.split_at(text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len()));
    let number: u64 = number.parse().map_err(|_| format!("`{text}` is not a duration like 500ms, 2s or 1m"))?;
    match unit {
        "ms" => Ok(Duration::from_millis(number)),
        "s" | "" => Ok(Duration::from_secs(number)),
        "m" => Ok(Duration::from_secs(number * 60)),
        _ => Err(format!("`{text}`: unknown unit `{unit}` (use ms, s or m)")),
    }
}

/// A poll period: a duration above zero (zero would spin).
pub(crate) fn parse_period(text: &str) -> Result<Duration, String> {
    match parse_duration(text)? {
        Duration::ZERO => Err(format!("`{text}`: the poll period must be above zero")),
        period => Ok(period),
    }
}
