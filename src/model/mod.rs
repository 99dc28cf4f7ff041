//! What the supervisor knows, with no I/O of its own beyond reading what it
//! is given: the mount table as parsed from the kernel ([`mountinfo`]), its
//! FUSE mounts classified into sources, targets and stacks ([`table`]), and
//! every target's state with the file it is kept in ([`state`]).
pub mod mountinfo;
pub mod state;
pub mod table;
