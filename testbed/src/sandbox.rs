//! A private mount namespace laid out like a node, owned by one thread.
use std::fs;
use std::io;
use std::panic::{self, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStderr, ChildStdout, Command, ExitStatus};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;

use fuse_supervisor_sys::mount::{self, Propagation};
use fuse_supervisor_sys::ns;
use fuse_supervisor_sys::process::{self, Signal};

use super::TestbedError;

type Task = Box<dyn FnOnce() + Send>;

/// A private mount namespace that looks like a node, for tests.
///
/// One dedicated thread unshares its mount namespace, makes `/` recursively
/// private (nothing reaches the host table) and mounts a *shared* tmpfs on a
/// fresh host directory (so binds form peer groups as on a node), with
/// `kubelet/` and `runtime/` as shared tmpfs mounts of their own (so a
/// container can detach its views of them, as `pivot_root` does). Every mount
/// change and every child process happens on that thread ([`Sandbox::run`],
/// [`Sandbox::spawn`]); children get `SIGKILL` when it exits.
///
/// Dropping the sandbox kills and reaps every child, then ends the thread: the
/// namespace, and every mount in it, goes with it.
///
/// Paths under [`Sandbox::root`] mean the sandbox's tmpfs only *inside* the
/// sandbox: other threads of the test see the bare host directory there. Work
/// on files through [`Sandbox::run`], or from outside through
/// [`Sandbox::outside_path`].
///
/// Do not call [`Sandbox::run`] or [`Sandbox::spawn`] from inside a closure
/// given to [`Sandbox::run`]: the thread would wait for itself.
pub struct Sandbox {
    root: PathBuf,
    thread_dir: PathBuf,
    tasks: Option<mpsc::Sender<Task>>,
    thread: Option<JoinHandle<()>>,
    children: Arc<Mutex<Vec<Arc<Mutex<Child>>>>>,
}

/// A process started with [`Sandbox::spawn`]. The sandbox kills it on drop;
/// it can be signalled or waited for earlier.
pub struct SandboxChild {
    pid: u32,
    child: Arc<Mutex<Child>>,
    stdout: Option<ChildStdout>,
    stderr: Option<ChildStderr>,
}

static NEXT_SANDBOX: AtomicU64 = AtomicU64::new(0);

impl Sandbox {
    /// Creates the namespace and its layout under a new directory in the
    /// system temporary directory.
    pub fn new() -> Result<Self, TestbedError> {
        let root = create_root()?;
        let (tasks, task_queue) = mpsc::channel::<Task>();
        let (ready, setup_result) = mpsc::channel();
        let setup_root = root.clone();
        let thread = std::thread::Builder::new().name("sandbox".into()).spawn(move || {
            let setup = set_up_namespace(&setup_root).map(|()| ns::thread_proc_dir());
            let failed = setup.is_err();
            // The receiver waits for this message; if it is gone, so is the sandbox.
            let _ = ready.send(setup);
            if failed {
                return;
            }
            for task in task_queue {
                task();
            }
        });
        let thread = match thread {
            Ok(thread) => thread,
            Err(source) => {
                let _ = fs::remove_dir(&root);
                return Err(TestbedError::StartThread(source));
            }
        };
        let setup = setup_result.recv().unwrap_or_else(|_| {
            Err(TestbedError::Setup { step: "sandbox thread died".into(), source: io::Error::other("no reply") })
        });
        match setup {
            Ok(thread_dir) => {
                Ok(Self { root, thread_dir, tasks: Some(tasks), thread: Some(thread), children: Arc::default() })
            }
            Err(err) => {
                let _ = thread.join();
                let _ = fs::remove_dir(&root);
                Err(err)
            }
        }
    }

    /// Runs `f` on the sandbox thread (in the sandbox namespace) and returns
    /// its result. A panic in `f` is resumed in the caller.
    pub fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        let (reply, result) = mpsc::sync_channel(1);
        let task: Task = Box::new(move || {
            let _ = reply.send(panic::catch_unwind(AssertUnwindSafe(f)));
        });
        let sent = self.tasks.as_ref().map(|tasks| tasks.send(task));
        match (sent, result.recv()) {
            (Some(Ok(())), Ok(Ok(value))) => value,
            (Some(Ok(())), Ok(Err(payload))) => panic::resume_unwind(payload),
            // Only possible if the sandbox thread is gone, which happens only in drop.
            _ => panic!("sandbox thread is gone"),
        }
    }

    /// Spawns `command` from the sandbox thread, so it lives in the sandbox
    /// namespace and gets `SIGKILL` when the sandbox ends.
    pub fn spawn(&self, mut command: Command) -> io::Result<SandboxChild> {
        let mut child = self.run(move || {
            process::kill_with_parent(&mut command);
            command.spawn()
        })?;
        let stdout = child.stdout.take();
        let stderr = child.stderr.take();
        let pid = child.id();
        let child = Arc::new(Mutex::new(child));
        self.children.lock().unwrap_or_else(PoisonError::into_inner).push(Arc::clone(&child));
        Ok(SandboxChild { pid, child, stdout, stderr })
    }

    /// The host directory the sandbox tmpfs is mounted on.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// `<root>/kubelet`, a shared mount standing for `/var/lib/kubelet`.
    pub fn kubelet_root(&self) -> PathBuf {
        self.root.join("kubelet")
    }

    /// `<root>/runtime`, a shared mount where global mounts live.
    pub fn runtime_root(&self) -> PathBuf {
        self.root.join("runtime")
    }

    /// `kubelet/pods/<uid>/volumes/kubernetes.io~csi/<volume>/mount` (not created).
    pub fn pod_volume_dir(&self, pod_uid: &str, volume: &str) -> PathBuf {
        self.kubelet_root().join("pods").join(pod_uid).join("volumes/kubernetes.io~csi").join(volume).join("mount")
    }

    /// `kubelet/pods/<uid>/volume-subpaths/<volume>/<container>/<index>` (not created).
    pub fn subpath_dir(&self, pod_uid: &str, volume: &str, container: &str, index: usize) -> PathBuf {
        self.kubelet_root()
            .join("pods")
            .join(pod_uid)
            .join("volume-subpaths")
            .join(volume)
            .join(container)
            .join(index.to_string())
    }

    /// `<root>/containers/<name>/rootfs`, created, outside kubelet and runtime.
    pub fn container_rootfs(&self, name: &str) -> io::Result<PathBuf> {
        let rootfs = self.root.join("containers").join(name).join("rootfs");
        let created = rootfs.clone();
        self.run(move || fs::create_dir_all(&created))?;
        Ok(rootfs)
    }

    /// The path under which any thread sees the sandbox's `path` (absolute):
    /// `/proc/<pid>/task/<tid>/root/<path>`, which resolves in the sandbox
    /// thread's mount namespace. Handy for reading and writing files from the
    /// test thread; never hand it to a process inside the sandbox.
    pub fn outside_path(&self, path: &Path) -> PathBuf {
        let relative = path.strip_prefix("/").unwrap_or(path);
        self.thread_dir.join("root").join(relative)
    }

    /// `/proc/<pid>/task/<tid>/ns/mnt` of the sandbox thread.
    pub fn namespace_path(&self) -> PathBuf {
        self.thread_dir.join("ns/mnt")
    }

    /// `/proc/<pid>/task/<tid>/mountinfo` of the sandbox thread.
    pub fn mountinfo_path(&self) -> PathBuf {
        self.thread_dir.join("mountinfo")
    }

    /// The sandbox's mount table, as `/proc/<pid>/task/<tid>/mountinfo`.
    pub fn mountinfo(&self) -> String {
        // The sandbox thread lives as long as `self`, so its proc entry exists.
        fs::read_to_string(self.thread_dir.join("mountinfo")).unwrap_or_default()
    }

    /// Non-recursive bind of `source` onto `target`, creating `target` (a
    /// directory) first.
    pub fn bind(&self, source: &Path, target: &Path) -> Result<(), TestbedError> {
        let (source_path, target) = (source.to_path_buf(), target.to_path_buf());
        self.run(move || {
            fs::create_dir_all(&target)
                .and_then(|()| mount::bind(&source_path, &target))
                .map_err(|source| TestbedError::Bind { source_path, target, source })
        })
    }

    /// Number of mounts in the sandbox whose mount point is `dir` or below it.
    pub fn count_mounts_under(&self, dir: &Path) -> usize {
        mount_points(&self.mountinfo()).filter(|point| point.starts_with(dir)).count()
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        let children = std::mem::take(&mut *self.children.lock().unwrap_or_else(PoisonError::into_inner));
        // Every child is killed before any is waited for: one waiting in the
        // kernel for a FUSE daemon's answer (a request the daemon read and
        // holds) exits only once that daemon is dead, whatever order they
        // were started in.
        for child in &children {
            // Already reaped or dead: nothing to do either way.
            let _ = child.lock().unwrap_or_else(PoisonError::into_inner).kill();
        }
        for child in children {
            let _ = child.lock().unwrap_or_else(PoisonError::into_inner).wait();
        }
        // Closing the queue ends the thread's loop; its namespace then dies
        // with its last member.
        self.tasks = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        // The tmpfs was never in the host table; what is left is the host
        // directory, holding whatever was written to it from outside the sandbox.
        let _ = fs::remove_dir_all(&self.root);
    }
}

impl std::fmt::Debug for Sandbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sandbox").field("root", &self.root).field("thread", &self.thread_dir).finish()
    }
}

impl SandboxChild {
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The child's stdout, if it was piped and not taken yet.
    pub fn take_stdout(&mut self) -> Option<ChildStdout> {
        self.stdout.take()
    }

    /// The child's stderr, if it was piped and not taken yet.
    pub fn take_stderr(&mut self) -> Option<ChildStderr> {
        self.stderr.take()
    }

    pub fn signal(&self, signal: Signal) -> io::Result<()> {
        process::signal(self.pid, signal)
    }

    /// `SIGKILL` (if still running) and reap.
    pub fn kill(&self) -> io::Result<ExitStatus> {
        let mut child = self.child.lock().unwrap_or_else(PoisonError::into_inner);
        let _ = child.kill();
        child.wait()
    }

    /// Waits for the child to exit.
    pub fn wait(&self) -> io::Result<ExitStatus> {
        self.child.lock().unwrap_or_else(PoisonError::into_inner).wait()
    }

    /// The exit status if the child has exited.
    pub fn try_wait(&self) -> io::Result<Option<ExitStatus>> {
        self.child.lock().unwrap_or_else(PoisonError::into_inner).try_wait()
    }
}

impl std::fmt::Debug for SandboxChild {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SandboxChild").field("pid", &self.pid).finish()
    }
}

/// A new directory for a sandbox, named by this process's pid. Pids are
/// reused (`pid_max` is 32768 on many machines, and a test run starts tens of
/// thousands of processes): a directory an earlier process of the same pid
/// left behind, killed before its sandboxes were dropped, is passed over.
fn create_root() -> Result<PathBuf, TestbedError> {
    const ATTEMPTS: usize = 1000;
    let mut attempt = 0;
    loop {
        let root = std::env::temp_dir().join(format!(
            "fuse-supervisor-sandbox-{}-{}",
            std::process::id(),
            NEXT_SANDBOX.fetch_add(1, Ordering::Relaxed)
        ));
        match fs::create_dir(&root) {
            Ok(()) => return Ok(root),
            Err(source) if source.kind() == io::ErrorKind::AlreadyExists && attempt + 1 < ATTEMPTS => attempt += 1,
            Err(source) => return Err(TestbedError::CreateRoot { path: root, source }),
        }
    }
}

/// Runs on the sandbox thread before anything else.
fn set_up_namespace(root: &Path) -> Result<(), TestbedError> {
    let step = |step: &str| {
        let step = step.to_string();
        move |source| TestbedError::Setup { step, source }
    };
    ns::unshare_mount_namespace().map_err(step("unshare mount namespace"))?;
    mount::set_propagation(Path::new("/"), Propagation::Private, true).map_err(step("make / rprivate"))?;
    mount::mount_tmpfs(root).map_err(step(&format!("mount tmpfs on {}", root.display())))?;
    mount::set_propagation(root, Propagation::Shared, false)
        .map_err(step(&format!("make {} shared", root.display())))?;
    for tree in ["kubelet", "runtime"] {
        let dir = root.join(tree);
        fs::create_dir(&dir).map_err(step(&format!("create {}", dir.display())))?;
        mount::mount_tmpfs(&dir).map_err(step(&format!("mount tmpfs on {}", dir.display())))?;
        mount::set_propagation(&dir, Propagation::Shared, false)
            .map_err(step(&format!("make {} shared", dir.display())))?;
    }
    let pods = root.join("kubelet/pods");
    fs::create_dir(&pods).map_err(step(&format!("create {}", pods.display())))?;
    Ok(())
}

/// Mount points (field 5) of a mountinfo text, with `\NNN` escapes decoded.
pub(crate) fn mount_points(mountinfo: &str) -> impl Iterator<Item = PathBuf> + '_ {
    mountinfo.lines().filter_map(|line| line.split(' ').nth(4)).map(unescape_octal)
}

fn unescape_octal(field: &str) -> PathBuf {
    use std::os::unix::ffi::OsStringExt;
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let escape = bytes.get(i + 1..i + 4).filter(|_| bytes[i] == b'\\');
        match escape.and_then(|digits| u8::from_str_radix(std::str::from_utf8(digits).ok()?, 8).ok()) {
            Some(byte) => {
                out.push(byte);
                i += 4;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    PathBuf::from(std::ffi::OsString::from_vec(out))
}
