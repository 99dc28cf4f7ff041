//! What the root benches share: their options, read from the command line
//! or the environment, and the check that they run as root.
//!
//! Each bench uses part of it (`#[allow(dead_code)]` on its `mod common`).
use std::str::FromStr;

/// `--flag value` arguments, else `<PREFIX>_FLAG` environment variables
/// (`--large-cycles` is `HEAL_BENCH_LARGE_CYCLES`), else defaults. Arguments
/// it does not know (cargo passes `--bench`) are ignored.
pub struct Flags {
    env_prefix: &'static str,
    args: Vec<String>,
}

impl Flags {
    pub fn new(env_prefix: &'static str) -> Flags {
        Flags { env_prefix, args: std::env::args().collect() }
    }

    pub fn text(&self, flag: &str, default: &str) -> String {
        let cli = self.args.windows(2).find(|pair| pair[0] == format!("--{flag}")).map(|pair| pair[1].clone());
        let env = || std::env::var(format!("{}_{}", self.env_prefix, flag.replace('-', "_").to_uppercase())).ok();
        cli.or_else(env).unwrap_or_else(|| default.to_owned())
    }

    /// A number; a value that is not one stops the bench with a message.
    pub fn number<T: FromStr>(&self, flag: &str, default: &str) -> T {
        self.text(flag, default).parse().unwrap_or_else(|_| panic!("--{flag} takes a number"))
    }

    /// Comma-separated values, each read with `parse`.
    pub fn list<T>(&self, flag: &str, default: &str, parse: impl Fn(&str) -> Option<T>) -> Vec<T> {
        self.text(flag, default)
            .split(',')
            .map(|item| parse(item).unwrap_or_else(|| panic!("--{flag}: cannot read {item:?}")))
            .collect()
    }

    /// One of the values `parse` knows.
    pub fn one<T>(&self, flag: &str, default: &str, parse: impl Fn(&str) -> Option<T>) -> T {
        let value = self.text(flag, default);
        parse(&value).unwrap_or_else(|| panic!("--{flag}: cannot read {value:?}"))
    }

    /// `on` or `off`.
    pub fn on_off(&self, flag: &str, default: &str) -> bool {
        match self.text(flag, default).as_str() {
            "on" => true,
            "off" => false,
            other => panic!("--{flag}: on or off, not {other}"),
        }
    }
}

/// Whether the process runs as root (real UID 0); unreadable status means
/// "not known to be root".
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|line| line.strip_prefix("Uid:").map(|ids| ids.split_whitespace().nth(1) == Some("0")))
        })
        .unwrap_or(false)
}

/// Binds `source` onto each of `targets` and mounts a tmpfs on each of
/// `pads`, creating the directories, from one task on the sandbox thread: a
/// table of the size a bench wants.
pub fn mount_targets_and_padding(
    sandbox: &fuse_supervisor_testbed::Sandbox,
    source: &std::path::Path,
    targets: Vec<std::path::PathBuf>,
    pads: Vec<std::path::PathBuf>,
) {
    use fuse_supervisor_sys::mount;
    let source = source.to_path_buf();
    sandbox
        .run(move || -> std::io::Result<()> {
            for target in &targets {
                std::fs::create_dir_all(target)?;
                mount::bind(&source, target)?;
            }
            for pad in &pads {
                std::fs::create_dir_all(pad)?;
                mount::mount_tmpfs(pad)?;
            }
            Ok(())
        })
        .expect("populate the sandbox's mount table");
}

/// `p50 … ms  p99 … ms  max … ms` of `took`, or `-` when empty.
pub fn summary_ms(mut took: Vec<std::time::Duration>) -> String {
    if took.is_empty() {
        return "-".into();
    }
    took.sort_unstable();
    let at = |q: f64| took[((took.len() - 1) as f64 * q).round() as usize].as_secs_f64() * 1000.0;
    format!("p50 {:.1} ms  p99 {:.1} ms  max {:.1} ms", at(0.5), at(0.99), at(1.0))
}

/// The agent's JSON log lines whose message is `message`, in order.
pub fn log_lines(
    supervisor: &fuse_supervisor_testbed::scenario::SupervisorProcess,
    message: &str,
) -> Vec<serde_json::Value> {
    let quoted = format!("\"message\":\"{message}\"");
    supervisor
        .log()
        .iter()
        .filter(|line| line.contains(&quoted))
        .filter_map(|line| serde_json::from_str(line).ok())
        .collect()
}

/// tracing's RFC 3339 timestamp of a log line.
pub fn timestamp(line: &serde_json::Value) -> std::time::SystemTime {
    let text = line["timestamp"].as_str().expect("a timestamp");
    let at = time::OffsetDateTime::parse(text, &time::format_description::well_known::Rfc3339).expect("RFC 3339");
    std::time::SystemTime::from(at)
}
