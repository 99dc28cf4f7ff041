//! A seccomp filter that refuses a set of system calls with one errno and
//! allows every other: what a container runtime's profile does to the
//! calls it does not list (ENOSYS, as the default profiles answer unknown
//! ones) or forbids (EPERM). The test world runs `run` under one to see
//! that a start without the new mount API fails clearly.
use std::io;

use linux_raw_sys::general as nr;

/// The calls of the new mount API (Linux 5.2; `mount_setattr` 5.12,
/// `open_tree_attr` 6.15), by name and number.
pub const NEW_MOUNT_API: [(&str, u32); 8] = [
    ("open_tree", nr::__NR_open_tree),
    ("move_mount", nr::__NR_move_mount),
    ("fsopen", nr::__NR_fsopen),
    ("fsconfig", nr::__NR_fsconfig),
    ("fsmount", nr::__NR_fsmount),
    ("fspick", nr::__NR_fspick),
    ("mount_setattr", nr::__NR_mount_setattr),
    ("open_tree_attr", nr::__NR_open_tree_attr),
];

/// What a profile answers a call it forbids with.
pub const EPERM: u16 = libc::EPERM as u16;
/// What the container runtimes' default profiles answer a call they do
/// not list with.
pub const ENOSYS: u16 = libc::ENOSYS as u16;

/// `setns`, by name and number.
pub const SETNS: (&str, u32) = ("setns", nr::__NR_setns);

/// `AUDIT_ARCH_*` of the architecture this is built for (`<linux/audit.h>`):
/// a filter checks it, since a call's number means another call on
/// another ABI.
#[cfg(target_arch = "x86_64")]
const AUDIT_ARCH: u32 = 0xC000_003E;
#[cfg(target_arch = "aarch64")]
const AUDIT_ARCH: u32 = 0xC000_00B7;

/// x86_64's x32 ABI: the same calls with this bit set in the number.
#[cfg(target_arch = "x86_64")]
const X32_SYSCALL_BIT: u32 = 0x4000_0000;

/// Offsets in `struct seccomp_data`.
const DATA_NR: u32 = 0;
const DATA_ARCH: u32 = 4;

fn statement(code: u32, k: u32) -> libc::sock_filter {
    // The BPF opcodes are 16 bits wide.
    libc::sock_filter { code: code as u16, jt: 0, jf: 0, k }
}

fn jump(code: u32, k: u32, jt: u8, jf: u8) -> libc::sock_filter {
    libc::sock_filter { code: code as u16, jt, jf, k }
}

/// The filter's program: another architecture kills the process; each of
/// `calls` (and, on x86_64, any x32 call) returns `errno`; the rest is
/// allowed.
fn program(calls: &[u32], errno: u16) -> io::Result<Vec<libc::sock_filter>> {
    let load = libc::BPF_LD | libc::BPF_W | libc::BPF_ABS;
    let equal = libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K;
    let mut checks = Vec::with_capacity(calls.len() + 1);
    #[cfg(target_arch = "x86_64")]
    checks.push((libc::BPF_JMP | libc::BPF_JGE | libc::BPF_K, X32_SYSCALL_BIT));
    checks.extend(calls.iter().map(|call| (equal, *call)));
    // Each check jumps over the checks after it and the allow, to the refusal.
    let too_many = || io::Error::new(io::ErrorKind::InvalidInput, "too many system calls for one filter");
    let mut program = vec![
        statement(load, DATA_ARCH),
        jump(equal, AUDIT_ARCH, 1, 0),
        statement(libc::BPF_RET | libc::BPF_K, libc::SECCOMP_RET_KILL_PROCESS),
        statement(load, DATA_NR),
    ];
    for (index, (code, k)) in checks.iter().enumerate() {
        let over = u8::try_from(checks.len() - index).map_err(|_| too_many())?;
        program.push(jump(*code, *k, over, 0));
    }
    program.push(statement(libc::BPF_RET | libc::BPF_K, libc::SECCOMP_RET_ALLOW));
    program.push(statement(libc::BPF_RET | libc::BPF_K, libc::SECCOMP_RET_ERRNO | u32::from(errno)));
    Ok(program)
}

/// Installs a filter on every thread of this process (and what it
/// executes) that makes each call of `calls` (numbers) fail with `errno`
/// and allows all others. Sets `no_new_privs` first, which a filter
/// installed without CAP_SYS_ADMIN requires. There is no way back.
pub fn refuse(calls: &[u32], errno: u16) -> io::Result<()> {
    let mut program = program(calls, errno)?;
    let len = u16::try_from(program.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "seccomp program too long"))?;
    let fprog = libc::sock_fprog { len, filter: program.as_mut_ptr() };
    // SAFETY: prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) takes integers only.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fprog` points at `program`, `len` instructions that live
    // until the call returns; the kernel copies them.
    let installed = unsafe {
        libc::syscall(
            libc::SYS_seccomp,
            libc::SECCOMP_SET_MODE_FILTER,
            libc::SECCOMP_FILTER_FLAG_TSYNC,
            &fprog as *const libc::sock_fprog,
        )
    };
    if installed != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_check_jumps_to_the_refusal() {
        let calls: Vec<u32> = NEW_MOUNT_API.iter().map(|(_, number)| *number).collect();
        let program = program(&calls, 1).unwrap();
        let refusal = program.len() - 1;
        assert_eq!(program[refusal].k, libc::SECCOMP_RET_ERRNO | 1);
        assert_eq!(program[refusal - 1].k, libc::SECCOMP_RET_ALLOW);
        let checks = &program[4..refusal - 1];
        for (index, check) in checks.iter().enumerate() {
            assert_eq!(4 + index + 1 + usize::from(check.jt), refusal, "check {index}");
        }
        assert!(checks.iter().any(|check| check.k == nr::__NR_open_tree));
    }
}
