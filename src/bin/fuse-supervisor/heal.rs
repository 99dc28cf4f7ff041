//! `heal --once`.
use fuse_supervisor::supervisor::{self, Config};

pub(crate) fn heal_once(config: &Config, dry_run: bool) -> anyhow::Result<()> {
    let config = config.clone();
    let summary = std::thread::spawn(move || supervisor::heal_once(&config, dry_run, &mut std::io::stdout()))
        .join()
        .map_err(|_| anyhow::anyhow!("heal thread panicked"))??;
    anyhow::ensure!(summary.failed == 0, "{} of {} target(s) not healed", summary.failed, summary.planned);
    Ok(())
}
