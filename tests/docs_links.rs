//! Every relative link of `README.md` and `docs/*.md` names a file that
//! exists, and every `#anchor` a heading of the page it points into, as
//! GitHub renders them: the docs are read through their links, so a moved
//! heading must not strand a reader.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

/// A relative link as written: the page it was found in and its line.
struct Link {
    page: PathBuf,
    line: usize,
    target: String,
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn pages() -> Vec<PathBuf> {
    let mut pages = vec![root().join("README.md")];
    let docs = root().join("docs");
    let entries = fs::read_dir(&docs).unwrap_or_else(|err| panic!("reading {}: {err}", docs.display()));
    for entry in entries {
        let path = entry.unwrap_or_else(|err| panic!("listing {}: {err}", docs.display())).path();
        if path.extension().is_some_and(|ext| ext == "md") {
            pages.push(path);
        }
    }
    pages.sort();
    pages
}

fn read(page: &Path) -> String {
    fs::read_to_string(page).unwrap_or_else(|err| panic!("reading {}: {err}", page.display()))
}

/// The lines of a page outside fenced code blocks, numbered from 1.
fn prose_lines(text: &str) -> Vec<(usize, &str)> {
    let mut fenced = false;
    let mut lines = Vec::new();
    for (index, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            lines.push((index + 1, line));
        }
    }
    lines
}

/// A line without its inline code spans, whose brackets are not links.
fn without_code_spans(line: &str) -> String {
    line.split('`').step_by(2).collect::<Vec<_>>().join("")
}

fn links(page: &Path) -> Vec<Link> {
    let text = read(page);
    let mut links = Vec::new();
    for (line_number, line) in prose_lines(&text) {
        let line = without_code_spans(line);
        let mut rest = line.as_str();
        while let Some(start) = rest.find("](") {
            rest = &rest[start + 2..];
            let Some(end) = rest.find(')') else { break };
            let target = &rest[..end];
            rest = &rest[end..];
            if !target.contains("://") && !target.starts_with("mailto:") {
                links.push(Link { page: page.to_path_buf(), line: line_number, target: target.to_owned() });
            }
        }
    }
    links
}

/// GitHub's anchor of a heading: lowercase, punctuation dropped except `-`
/// and `_`, spaces made hyphens; a repeated one gets `-1`, `-2`…
fn anchors(page: &Path) -> BTreeSet<String> {
    let text = read(page);
    let mut anchors = BTreeSet::new();
    for (_, line) in prose_lines(&text) {
        let Some(heading) = line.strip_prefix('#') else { continue };
        let heading = heading.trim_start_matches('#');
        if !heading.starts_with(' ') {
            continue;
        }
        let slug: String = heading
            .trim()
            .to_lowercase()
            .chars()
            .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
            .map(|c| if c == ' ' { '-' } else { c })
            .collect();
        let mut unique = slug.clone();
        let mut repeat = 0;
        while anchors.contains(&unique) {
            repeat += 1;
            unique = format!("{slug}-{repeat}");
        }
        anchors.insert(unique);
    }
    anchors
}

#[test]
fn every_relative_link_and_anchor_resolves() {
    let mut broken = Vec::new();
    let mut checked = 0;
    for page in pages() {
        for link in links(&page) {
            checked += 1;
            let (path, anchor) = match link.target.split_once('#') {
                Some((path, anchor)) => (path, Some(anchor)),
                None => (link.target.as_str(), None),
            };
            let dir = link.page.parent().unwrap_or_else(|| panic!("{} has no directory", link.page.display()));
            let target = if path.is_empty() { link.page.clone() } else { dir.join(path) };
            let place = format!("{}:{}: ({})", link.page.display(), link.line, link.target);
            if !target.exists() {
                broken.push(format!("{place}: no such file {}", target.display()));
                continue;
            }
            if let Some(anchor) = anchor {
                if target.extension().is_none_or(|ext| ext != "md") {
                    broken.push(format!("{place}: an anchor into a page that is not markdown"));
                } else if !anchors(&target).contains(anchor) {
                    broken.push(format!("{place}: no heading #{anchor} in {}", target.display()));
                }
            }
        }
    }
    assert!(checked > 0, "no relative link found in README.md and docs/: is the scan broken?");
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn anchors_follow_github() {
    let dir = std::env::temp_dir().join(format!("fuse-supervisor-docs-links-{}", std::process::id()));
    fs::create_dir_all(&dir).unwrap_or_else(|err| panic!("creating {}: {err}", dir.display()));
    let page = dir.join("page.md");
    let text = "# Sidecar mode\n## 1. Probe the new source\n## What `--flag` does, and why\n```\n# not a heading\n```\n## Sidecar mode\n#nospace\n";
    fs::write(&page, text).unwrap_or_else(|err| panic!("writing {}: {err}", page.display()));
    let found = anchors(&page);
    fs::remove_dir_all(&dir).unwrap_or_else(|err| panic!("removing {}: {err}", dir.display()));
    let expected: BTreeSet<String> =
        ["sidecar-mode", "1-probe-the-new-source", "what---flag-does-and-why", "sidecar-mode-1"]
            .into_iter()
            .map(String::from)
            .collect();
    assert_eq!(found, expected);
}
