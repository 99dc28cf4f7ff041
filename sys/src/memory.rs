//! Giving freed heap memory back to the kernel.

/// `malloc_trim(0)` (glibc): returns every free page of every malloc arena to
/// the kernel, not only the top of the heap. After a scan of a large table the
/// freed memory is scattered between long-lived allocations, where glibc
/// would otherwise keep it resident for good. A no-op with other C libraries.
pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim has no preconditions; it only walks and trims the
    // allocator's own arenas, under their locks.
    unsafe {
        libc::malloc_trim(0);
    }
}
