//! How the process's heap gives memory back to the kernel (glibc malloc).
//!
//! With other C libraries both functions do nothing.

/// `mallopt(M_MMAP_THRESHOLD, bytes)`: every allocation of at least `bytes`
/// gets pages of its own, returned to the kernel as soon as it is freed.
///
/// glibc starts at 128 KiB but raises the threshold whenever such a block is
/// freed (up to 32 MiB); from then on the megabyte-sized buffers of a scan of
/// a large table are carved from the heap, where the long-lived allocations
/// made meanwhile pin their pages. Setting the threshold turns that off. Returns
/// whether the allocator took it.
pub fn set_mmap_threshold(bytes: usize) -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let Ok(bytes) = libc::c_int::try_from(bytes) else { return false };
        // SAFETY: mallopt only changes the allocator's tuning parameters,
        // under its own lock; M_MMAP_THRESHOLD takes any non-negative int.
        unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, bytes) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        let _ = bytes;
        false
    }
}

/// `malloc_trim(0)`: returns every free page of every malloc arena to the
/// kernel, not only the top of the heap. After a scan of a large table the
/// freed memory is scattered between long-lived allocations, where glibc
/// would otherwise keep it resident for good.
pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim has no preconditions; it only walks and trims the
    // allocator's own arenas, under their locks.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn glibc_takes_a_threshold_and_refuses_one_too_large() {
        assert!(set_mmap_threshold(128 * 1024));
        assert!(!set_mmap_threshold(usize::MAX), "does not fit an int");
    }
}
