//! Kubernetes label selectors in their string form (`kubectl -l`), matched
//! against a pod's labels: which pods the Job lifecycle manages.
//!
//! Requirements are joined by commas, all must hold: `key=value`,
//! `key==value`, `key!=value` (also true when the key is absent), `key`
//! (present), `!key` (absent), `key in (a,b)`, `key notin (a,b)`.
use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("label selector {selector:?}: {problem}")]
pub struct SelectorError {
    pub selector: String,
    pub problem: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Requirement {
    Equals(String, String),
    NotEquals(String, String),
    Exists(String),
    Absent(String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
}

impl Requirement {
    fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        match self {
            Requirement::Equals(key, value) => labels.get(key) == Some(value),
            Requirement::NotEquals(key, value) => labels.get(key) != Some(value),
            Requirement::Exists(key) => labels.contains_key(key),
            Requirement::Absent(key) => !labels.contains_key(key),
            Requirement::In(key, values) => labels.get(key).is_some_and(|value| values.contains(value)),
            Requirement::NotIn(key, values) => labels.get(key).is_none_or(|value| !values.contains(value)),
        }
    }
}

/// A parsed selector; the empty selector matches every pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LabelSelector {
    text: String,
    requirements: Vec<Requirement>,
}

impl LabelSelector {
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.requirements.iter().all(|requirement| requirement.matches(labels))
    }
}

impl fmt::Display for LabelSelector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl FromStr for LabelSelector {
    type Err = SelectorError;

    fn from_str(text: &str) -> Result<Self, SelectorError> {
        let error = |problem: String| SelectorError { selector: text.to_owned(), problem };
        let mut requirements = Vec::new();
        for part in split_top_level(text) {
            let part = part.trim();
            if part.is_empty() {
                if text.trim().is_empty() {
                    continue;
                }
                return Err(error("empty requirement".into()));
            }
            requirements.push(parse_requirement(part).map_err(error)?);
        }
        Ok(LabelSelector { text: text.trim().to_owned(), requirements })
    }
}

/// Splits at commas outside parentheses (the value lists of `in`/`notin`).
fn split_top_level(text: &str) -> Vec<&str> {
    let (mut parts, mut depth, mut start) = (Vec::new(), 0usize, 0);
    for (at, c) in text.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                parts.push(&text[start..at]);
                start = at + 1;
            }
            _ => {}
        }
    }
    parts.push(&text[start..]);
    parts
}

fn parse_requirement(part: &str) -> Result<Requirement, String> {
    if let Some(key) = part.strip_prefix('!') {
        return Ok(Requirement::Absent(key_of(key.trim())?));
    }
    for (op, make) in [
        ("!=", Requirement::NotEquals as fn(String, String) -> Requirement),
        ("==", Requirement::Equals),
        ("=", Requirement::Equals),
    ] {
        if let Some((key, value)) = part.split_once(op) {
            return Ok(make(key_of(key.trim())?, value_of(value.trim())?));
        }
    }
    let mut words = part.splitn(2, char::is_whitespace);
    let key = key_of(words.next().unwrap_or_default())?;
    let Some(rest) = words.next().map(str::trim) else { return Ok(Requirement::Exists(key)) };
    let (set_op, list) = if let Some(list) = rest.strip_prefix("notin") {
        ("notin", list)
    } else if let Some(list) = rest.strip_prefix("in") {
        ("in", list)
    } else {
        return Err(format!("unknown operator in {part:?}"));
    };
    let list = list.trim();
    let inner = list
        .strip_prefix('(')
        .and_then(|list| list.strip_suffix(')'))
        .ok_or_else(|| format!("{set_op} needs a list in parentheses in {part:?}"))?;
    let values = inner.split(',').map(|value| value_of(value.trim())).collect::<Result<Vec<_>, _>>()?;
    Ok(if set_op == "in" { Requirement::In(key, values) } else { Requirement::NotIn(key, values) })
}

/// A label key: an optional DNS-subdomain prefix and `/`, then a name of
/// letters, digits, `-`, `_` and `.`.
fn key_of(key: &str) -> Result<String, String> {
    let name = key.rsplit_once('/').map_or(key, |(_, name)| name);
    if name.is_empty() || !key.chars().all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c)) {
        return Err(format!("invalid label key {key:?}"));
    }
    Ok(key.to_owned())
}

fn value_of(value: &str) -> Result<String, String> {
    if !value.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) {
        return Err(format!("invalid label value {value:?}"));
    }
    Ok(value.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn fluid_default_and_every_operator() {
        let fluid: LabelSelector = "done.sidecar.fluid.io/inject=true".parse().unwrap();
        assert!(fluid.matches(&labels(&[("done.sidecar.fluid.io/inject", "true"), ("app", "x")])));
        assert!(!fluid.matches(&labels(&[("done.sidecar.fluid.io/inject", "false")])));
        assert!(!fluid.matches(&labels(&[])));

        let all: LabelSelector = "tier in (batch, etl),env!=prod,team,!legacy,zone notin (a),x==y".parse().unwrap();
        let good = labels(&[("tier", "etl"), ("env", "dev"), ("team", "d"), ("x", "y")]);
        assert!(all.matches(&good));
        for (key, value) in [("tier", "web"), ("env", "prod"), ("legacy", "1"), ("zone", "a"), ("x", "z")] {
            let mut bad = good.clone();
            bad.insert(key.into(), value.into());
            assert!(!all.matches(&bad), "{key}={value}");
        }
        let mut no_team = good.clone();
        no_team.remove("team");
        assert!(!all.matches(&no_team));
        assert_eq!(all.to_string(), "tier in (batch, etl),env!=prod,team,!legacy,zone notin (a),x==y");
    }

    #[test]
    fn empty_matches_everything_and_errors_name_the_selector() {
        assert!("".parse::<LabelSelector>().unwrap().matches(&labels(&[])));
        for bad in ["a=b,,c", "a b", "tier in batch", "=x", "a=b c", "k in (a b)"] {
            let err = bad.parse::<LabelSelector>().unwrap_err();
            assert!(err.to_string().starts_with(&format!("label selector {bad:?}: ")), "{err}");
        }
    }
}
