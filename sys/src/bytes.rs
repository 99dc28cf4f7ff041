//! Native-endian fields of kernel records read out of byte buffers, checked
//! against the buffer's end and read byte-wise (a record's fields need not
//! be aligned in the buffer).

/// The `u16` at `offset`, or None past the end.
pub(crate) fn u16_at(bytes: &[u8], offset: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(bytes.get(offset..offset.checked_add(2)?)?.try_into().ok()?))
}

/// The `u32` at `offset`, or None past the end.
pub(crate) fn u32_at(bytes: &[u8], offset: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(bytes.get(offset..offset.checked_add(4)?)?.try_into().ok()?))
}

/// The `u64` at `offset`, or None past the end.
pub(crate) fn u64_at(bytes: &[u8], offset: usize) -> Option<u64> {
    Some(u64::from_ne_bytes(bytes.get(offset..offset.checked_add(8)?)?.try_into().ok()?))
}
