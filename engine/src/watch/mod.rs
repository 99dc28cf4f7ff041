//! Thin adapters over the kernel's notifications: each decodes events into
//! typed values for the loop and decides nothing. The mount table
//! ([`mount_table`]: fanotify mount events, mountinfo `EPOLLPRI`, or a poll
//! for comparison), processes ([`processes`]: the proc connector or pidfds,
//! for FUSE daemon deaths) and the kubelet's pod directories ([`pods`]:
//! inotify), and [`dir_changes`]: "something changed in these directories".
//! Every one runs on a thread owned by a [`thread::Watching`], started and
//! stopped the same way.
pub mod dir_changes;
pub mod mount_table;
pub mod namespace_changes;
pub mod pods;
pub mod processes;
pub mod thread;
