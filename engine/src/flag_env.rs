//! The environment variables the programs' flags read: every one starts
//! with [`PREFIX`]. clap ignores a variable that no flag reads, so a
//! manifest's variable for a renamed flag would fall back to the default
//! unnoticed; `--check-config` names such variables as an error.
use std::collections::BTreeSet;
use std::ffi::OsStr;

/// Every flag's environment variable starts with this.
pub const PREFIX: &str = "FUSE_SUPERVISOR_";

/// The variables of this process's environment that start with [`PREFIX`]
/// and are not in `read`.
pub fn unread(read: &BTreeSet<&OsStr>) -> Vec<String> {
    std::env::vars_os()
        .map(|(key, _)| key)
        .filter(|key| key.to_string_lossy().starts_with(PREFIX) && !read.contains(key.as_os_str()))
        .map(|key| key.to_string_lossy().into_owned())
        .collect()
}
