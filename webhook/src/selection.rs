//! Which volumes the webhook looks after: by CSI driver or StorageClass,
//! unless the pod opts out.
use std::collections::HashSet;

/// The default opt-out annotation: a pod that carries it with the value
/// `"true"` is admitted unchanged.
pub const DEFAULT_OPT_OUT_ANNOTATION: &str = "fuse-supervisor.io/skip-mount-propagation";

/// Which volumes are FUSE volumes the supervisor heals.
#[derive(Debug, Clone, Default)]
pub struct Selection {
    drivers: HashSet<String>,
    classes: HashSet<String>,
    opt_out_annotation: String,
}

impl Selection {
    /// CSI driver names and StorageClass names; a volume is selected when
    /// either matches.
    pub fn new(
        drivers: impl IntoIterator<Item = String>,
        classes: impl IntoIterator<Item = String>,
        opt_out_annotation: impl Into<String>,
    ) -> Self {
        Selection {
            drivers: drivers.into_iter().collect(),
            classes: classes.into_iter().collect(),
            opt_out_annotation: opt_out_annotation.into(),
        }
    }

    pub fn has_driver(&self, driver: &str) -> bool {
        self.drivers.contains(driver)
    }

    pub fn has_class(&self, class: &str) -> bool {
        self.classes.contains(class)
    }

    pub fn drivers_empty(&self) -> bool {
        self.drivers.is_empty()
    }

    /// Nothing can ever be selected.
    pub fn is_empty(&self) -> bool {
        self.drivers.is_empty() && self.classes.is_empty()
    }

    pub fn opt_out_annotation(&self) -> &str {
        &self.opt_out_annotation
    }
}
