//! Source layouts of the user's own (`--layout-config`): a TOML file of
//! path templates, one per CSI driver, with placeholders for what the
//! target's `vol_data.json` and path say.
use std::path::{Component, Path, PathBuf};

use serde::Deserialize;

use super::{LayoutError, LayoutName, TargetInfo, sha256_hex};

/// A user rule: the source path template for one CSI driver.
#[derive(Clone, Debug)]
pub(super) struct UserRule {
    driver: String,
    template: Vec<Segment>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Segment {
    Text(String),
    Field(Field),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Field {
    KubeletRoot,
    Driver,
    VolumeHandle,
    VolumeHandleSha256,
    SpecVolId,
    PodUid,
    Volume,
}

impl Field {
    const ALL: [(&'static str, Field); 7] = [
        ("kubeletRoot", Field::KubeletRoot),
        ("driver", Field::Driver),
        ("volumeHandle", Field::VolumeHandle),
        ("volumeHandleSha256", Field::VolumeHandleSha256),
        ("specVolID", Field::SpecVolId),
        ("podUID", Field::PodUid),
        ("volume", Field::Volume),
    ];
}

impl UserRule {
    pub(super) fn name(&self) -> LayoutName {
        LayoutName::UserRule { driver: self.driver.clone() }
    }

    /// The source path for `target`, if the rule is for its driver and the
    /// path has no `.`/`..` (a value with `..` must not climb out).
    pub(super) fn expand(&self, target: &TargetInfo<'_>, kubelet_root: &Path) -> Option<PathBuf> {
        let data = target.vol_data.filter(|data| *data.driver_name == *self.driver)?;
        let mut path = String::new();
        for segment in &self.template {
            match segment {
                Segment::Text(text) => path.push_str(text),
                Segment::Field(Field::KubeletRoot) => path.push_str(kubelet_root.to_str()?),
                Segment::Field(Field::Driver) => path.push_str(&data.driver_name),
                Segment::Field(Field::VolumeHandle) => path.push_str(&data.volume_handle),
                Segment::Field(Field::VolumeHandleSha256) => path.push_str(&sha256_hex(&data.volume_handle)),
                Segment::Field(Field::SpecVolId) => path.push_str(&data.spec_vol_id),
                Segment::Field(Field::PodUid) => path.push_str(target.pod_uid),
                Segment::Field(Field::Volume) => path.push_str(target.volume),
            }
        }
        let path = PathBuf::from(path);
        let plain = path.components().all(|part| matches!(part, Component::RootDir | Component::Normal(_)));
        (path.is_absolute() && plain).then_some(path)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ConfigFile {
    #[serde(default)]
    rule: Vec<RuleEntry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RuleEntry {
    driver: toml::Spanned<String>,
    source: toml::Spanned<String>,
}

pub(super) fn parse_rules(text: &str, path: &Path) -> Result<Vec<UserRule>, LayoutError> {
    let line_of = |offset: usize| text[..offset.min(text.len())].matches('\n').count() + 1;
    let config: ConfigFile = toml::from_str(text).map_err(|err| LayoutError::Syntax {
        path: path.to_path_buf(),
        line: err.span().map_or(1, |span| line_of(span.start)),
        message: err.message().trim_end().to_owned(),
    })?;
    let mut rules: Vec<UserRule> = Vec::with_capacity(config.rule.len());
    for entry in config.rule {
        let driver = entry.driver.get_ref().clone();
        let rule_error = |span: std::ops::Range<usize>, problem: String| LayoutError::Rule {
            path: path.to_path_buf(),
            line: line_of(span.start),
            driver: driver.clone(),
            problem,
        };
        if rules.iter().any(|rule| rule.driver == driver) {
            return Err(rule_error(entry.driver.span(), "a second rule for the same driver".into()));
        }
        let template =
            parse_template(entry.source.get_ref()).map_err(|problem| rule_error(entry.source.span(), problem))?;
        rules.push(UserRule { driver, template });
    }
    Ok(rules)
}

fn parse_template(source: &str) -> Result<Vec<Segment>, String> {
    let mut segments = Vec::new();
    let mut rest = source;
    while let Some(open) = rest.find(['{', '}']) {
        if rest[open..].starts_with('}') {
            return Err(format!("unmatched '}}' in source template {source:?}"));
        }
        if open > 0 {
            segments.push(Segment::Text(rest[..open].to_owned()));
        }
        let Some(close) = rest[open..].find('}') else {
            return Err(format!("unclosed '{{' in source template {source:?}"));
        };
        let name = &rest[open + 1..open + close];
        let Some((_, field)) = Field::ALL.iter().find(|(known, _)| *known == name) else {
            let known: Vec<String> = Field::ALL.iter().map(|(known, _)| format!("{{{known}}}")).collect();
            return Err(format!("unknown placeholder {{{name}}} (known: {})", known.join(" ")));
        };
        segments.push(Segment::Field(*field));
        rest = &rest[open + close + 1..];
    }
    if !rest.is_empty() {
        segments.push(Segment::Text(rest.to_owned()));
    }
    let absolute = match segments.first() {
        Some(Segment::Text(text)) => text.starts_with('/'),
        Some(Segment::Field(field)) => *field == Field::KubeletRoot,
        None => false,
    };
    if !absolute {
        return Err(format!("source template {source:?} must start with '/' or {{kubeletRoot}}"));
    }
    Ok(segments)
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use super::super::SourceLayouts;

    const KUBELET: &str = "/var/lib/kubelet";

    fn fixture(path: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures").join(path)
    }

    #[test]
    fn config_errors_name_file_line_and_rule() {
        let error = |name: &str| {
            SourceLayouts::new(Path::new(KUBELET))
                .with_rules_from(&fixture(&format!("layout-config/{name}")))
                .unwrap_err()
                .to_string()
        };
        let file = |name: &str| fixture(&format!("layout-config/{name}")).display().to_string();
        assert_eq!(
            error("unknown-placeholder.toml"),
            format!(
                "layout config {} line 7: rule for driver rclone.csi.example.com: unknown placeholder {{pvName}} \
                 (known: {{kubeletRoot}} {{driver}} {{volumeHandle}} {{volumeHandleSha256}} {{specVolID}} {{podUID}} {{volume}})",
                file("unknown-placeholder.toml")
            )
        );
        assert!(error("bad-syntax.toml").starts_with(&format!("layout config {} line 3: ", file("bad-syntax.toml"))));
        assert!(error("unknown-key.toml").starts_with(&format!("layout config {} line 3: ", file("unknown-key.toml"))));
        assert_eq!(
            error("relative.toml"),
            format!(
                "layout config {} line 3: rule for driver nfs-fuse.example.com: source template \
                 \"mnt/fuse/{{volumeHandle}}\" must start with '/' or {{kubeletRoot}}",
                file("relative.toml")
            )
        );
        assert_eq!(
            error("duplicate.toml"),
            format!(
                "layout config {} line 6: rule for driver nfs-fuse.example.com: a second rule for the same driver",
                file("duplicate.toml")
            )
        );
        assert!(error("missing.toml").starts_with("cannot read layout config"));
    }
}
