//! The detach of a dead daemon's own mount (`--detach-dead-sources`) never
//! takes a mount a new daemon makes over it meanwhile: the dead mount is
//! unmounted in two steps of `umount2(MNT_EXPIRE)` with a look between them
//! that nothing was mounted on it (`listmount`), and detached lazily only
//! when it is in use. Needs root.
use std::io::ErrorKind;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

use fuse_supervisor_engine::heal::priority::HealPriority;
use fuse_supervisor_engine::heal::{Executor, MountExecutor};
use fuse_supervisor_engine::model::table::{Dev, Snapshot};
use fuse_supervisor_sys::{listmount, mount, resolve};
use fuse_supervisor_testbed::scenario::{Daemon, FuseSource, layers_at};
use fuse_supervisor_testbed::{CapturedLogs, Sandbox};

const LAZILY: &str = "the dead source is in use: detached lazily";

/// The kernel's behaviour the detach stands on, with tmpfs mounts: the first
/// expiry marks the top mount, the second unmounts it if it is still the
/// marked one; `listmount` of its children does not clear the mark; a mount
/// made on top in between is unmarked, so the second step leaves it, and
/// `listmount` shows it on the dead mount. A step that finds the mount
/// held (EBUSY: another task's path walk through it, for a moment, on a
/// loaded machine) says nothing of these and is taken again.
#[test]
fn an_expiry_in_two_steps_never_takes_a_mount_made_in_between() {
    let sandbox = Sandbox::new().expect("sandbox");
    let dir = sandbox.root().join("runtime/dead");
    let outcome = sandbox.run(move || -> std::io::Result<Vec<String>> {
        std::fs::create_dir_all(&dir)?;
        let mut seen = Vec::new();
        let unique = |dir: &Path| resolve::unique_mount_id_of(resolve::open_path(dir)?.as_fd());
        let expire = |dir: &Path| {
            let mut tries = 0;
            loop {
                match mount::expire(dir) {
                    Err(err) if err.kind() == ErrorKind::ResourceBusy && tries < 100 => {
                        tries += 1;
                        std::thread::sleep(std::time::Duration::from_millis(1));
                    }
                    outcome => return format!("{:?}", outcome.map_err(|err| err.kind())),
                }
            }
        };
        mount::mount_tmpfs(&dir)?;
        let dead = unique(&dir)?;
        seen.push(expire(&dir));
        seen.push(format!("{:?}", listmount::children(dead, 1)?));
        seen.push(expire(&dir));
        seen.push(format!("{:?}", listmount::children(dead, 1).map_err(|err| err.kind())));

        mount::mount_tmpfs(&dir)?;
        let dead = unique(&dir)?;
        seen.push(expire(&dir));
        mount::mount_tmpfs(&dir)?;
        let new = unique(&dir)?;
        seen.push(format!("{}", listmount::children(dead, 1)? == [new]));
        seen.push(expire(&dir));
        seen.push(format!("{}", unique(&dir)? == new));
        Ok(seen)
    });
    let seen = outcome.expect("the steps");
    assert_eq!(
        seen,
        ["Err(WouldBlock)", "[]", "Ok(())", "Err(NotFound)", "Err(WouldBlock)", "true", "Err(WouldBlock)", "true",]
    );
}

/// A dead source and the executor that detaches it.
struct DeadSource {
    sandbox: Sandbox,
    path: PathBuf,
    dead: Dev,
}

impl DeadSource {
    fn new() -> DeadSource {
        let sandbox = Sandbox::new().expect("sandbox");
        let mut source = FuseSource::start(&sandbox, Daemon::Bindfs, "data").expect("bindfs");
        let snapshot = Snapshot::parse(sandbox.mountinfo().as_bytes()).expect("table");
        let dead = snapshot.fuse_mounts.iter().find(|mount| mount.mount_point == source.path).expect("mounted").dev;
        source.crash().expect("crash");
        let path = source.path.clone();
        DeadSource { sandbox, path, dead }
    }

    /// The executor's detach, and what it logged.
    fn detach(&self, hold: bool) -> (bool, String) {
        let (kubelet_root, staging, path, dead) =
            (self.sandbox.kubelet_root(), self.sandbox.root().join("staging"), self.path.clone(), self.dead);
        self.sandbox.run(move || {
            let mut executor = MountExecutor::new(&kubelet_root, &staging, HealPriority::OFF).expect("executor");
            // A process with the dead mount open keeps it busy.
            let _held = hold.then(|| resolve::open_path(&path).expect("open the dead source"));
            let logs = CapturedLogs::default();
            let detached = logs.capture(tracing::Level::DEBUG, || executor.detach_dead_source(&path, dead));
            (detached.expect("detach"), logs.text())
        })
    }
}

#[test]
fn an_unused_dead_source_is_unmounted_by_expiry() {
    let source = DeadSource::new();
    let (detached, logs) = source.detach(false);
    assert!(detached);
    assert!(!logs.contains(LAZILY), "{logs}");
    assert_eq!(layers_at(&source.sandbox, &source.path), 0);
}

#[test]
fn a_dead_source_in_use_is_detached_lazily() {
    let source = DeadSource::new();
    let (detached, logs) = source.detach(true);
    assert!(detached);
    assert!(logs.contains(LAZILY), "{logs}");
    assert_eq!(layers_at(&source.sandbox, &source.path), 0);
}
