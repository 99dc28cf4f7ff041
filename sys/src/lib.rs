//! The Linux syscall layer of fuse-supervisor.
//!
//! Every syscall the program makes lives here, typed and documented; the
//! decisions live in the `fuse-supervisor` crate. Prefer rustix's safe
//! wrappers; raw calls only for what no crate exposes yet.
#![deny(unsafe_op_in_unsafe_fn)]

mod bytes;

pub mod fanotify;
pub mod fd_messages;
pub mod fds;
pub mod fuse;
pub mod inotify;
pub mod listmount;
pub mod memory;
pub mod mount;
pub mod mountinfo_poll;
pub mod ns;
pub mod pidfd;
pub mod poll;
pub mod probe;
pub mod proc_connector;
pub mod process;
pub mod resolve;
pub mod seccomp;
pub mod statmount;
