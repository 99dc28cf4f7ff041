//! What the supervisor knows, with no I/O of its own beyond reading what it
//! is given: the mount table as parsed from the kernel ([`mountinfo`]), its
//! FUSE mounts classified into sources, targets and stacks ([`table`]), and
//! every target's state with the file it is kept in ([`state`]); the FUSE
//! mounts kept from mount events, one mount at a time ([`incremental`]), and
//! the loop's seam to whichever of the two it reads ([`source`]).
pub mod incremental;
pub mod mountinfo;
pub mod namespace_table;
pub mod path_map;
pub mod source;
pub mod state;
pub mod table;
