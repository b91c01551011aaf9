//! Node labels (`k=v,k2=v2`) and Ray 2.x-style label selectors that match against them.

use std::collections::BTreeMap;
use std::fmt;

/// Our label prefix; `ray.io/` keys are aliases of it (SCHED-8, TPU.md).
pub const TPURAY_PREFIX: &str = "tpuray.io/";
/// Ray's label prefix; `tpuray.io/` keys are aliases of it (SCHED-8).
pub const RAY_PREFIX: &str = "ray.io/";

/// A problem with a label string or a label selector.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LabelError {
    /// A comma-separated piece without `=`.
    #[error("invalid label {0:?} (expected key=value)")]
    InvalidPair(String),
    /// A pair whose key is empty.
    #[error("invalid label {0:?} has an empty key (expected key=value)")]
    EmptyKey(String),
    /// A key given twice.
    #[error("duplicate label key {0:?} (each key may appear once)")]
    DuplicateKey(String),
    /// A selector entry whose key is empty.
    #[error("label selector has an empty key for value {0:?} (expected a label key)")]
    EmptySelectorKey(String),
    /// A selector value that does not follow the syntax.
    #[error(
        "invalid label selector {key:?}: {value:?} (expected \"value\", \"!value\", \"in(a,b)\" or \"!in(a,b)\")"
    )]
    InvalidSelector { key: String, value: String },
}

/// A node's labels, key to value.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Labels(pub BTreeMap<String, String>);

/// The other spelling of a `tpuray.io/K` or `ray.io/K` key (SCHED-8).
pub fn label_key_alias(key: &str) -> Option<String> {
    if let Some(rest) = key.strip_prefix(TPURAY_PREFIX) {
        Some(format!("{RAY_PREFIX}{rest}"))
    } else {
        key.strip_prefix(RAY_PREFIX).map(|rest| format!("{TPURAY_PREFIX}{rest}"))
    }
}

impl Labels {
    /// Parses `k=v,k2=v2` (spaces around keys and values are trimmed; values may be empty
    /// and may hold `=`). An empty string gives no labels. Errors: a piece without `=`, an
    /// empty key, a key given twice.
    pub fn parse(s: &str) -> Result<Labels, LabelError> {
        let mut map = BTreeMap::new();
        if s.trim().is_empty() {
            return Ok(Labels(map));
        }
        for pair in s.split(',') {
            let Some((k, v)) = pair.split_once('=') else {
                return Err(LabelError::InvalidPair(pair.to_string()));
            };
            let k = k.trim();
            if k.is_empty() {
                return Err(LabelError::EmptyKey(pair.to_string()));
            }
            if map.insert(k.to_string(), v.trim().to_string()).is_some() {
                return Err(LabelError::DuplicateKey(k.to_string()));
            }
        }
        Ok(Labels(map))
    }

    /// The value of `k`; when absent, the value of its `ray.io/`/`tpuray.io/` alias (SCHED-8).
    pub fn get(&self, k: &str) -> Option<&str> {
        match self.0.get(k) {
            Some(v) => Some(v),
            None => label_key_alias(k).and_then(|a| self.0.get(&a)).map(String::as_str),
        }
    }
}

/// What a selector entry requires of a label's value.
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum LabelOp {
    /// The label is present with one of these values.
    In(Vec<String>),
    /// The label is absent or has none of these values (as in Ray).
    NotIn(Vec<String>),
    /// The label is present (any value).
    Exists,
    /// The label is absent.
    DoesNotExist,
}

/// One selector entry: `key` must satisfy `op`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct LabelConstraint {
    pub key: String,
    pub op: LabelOp,
}

impl LabelConstraint {
    /// True when `labels` satisfy this constraint; `ray.io/K` and `tpuray.io/K` are the same
    /// key (SCHED-8).
    pub fn matches(&self, labels: &Labels) -> bool {
        let value = labels.get(&self.key);
        match (&self.op, value) {
            (LabelOp::In(vals), Some(v)) => vals.iter().any(|x| x == v),
            (LabelOp::In(_), None) => false,
            (LabelOp::NotIn(vals), Some(v)) => !vals.iter().any(|x| x == v),
            (LabelOp::NotIn(_), None) => true,
            (LabelOp::Exists, v) => v.is_some(),
            (LabelOp::DoesNotExist, v) => v.is_none(),
        }
    }
}

/// True when every constraint matches (an empty selector matches every node).
pub fn selector_matches(selector: &[LabelConstraint], labels: &Labels) -> bool {
    selector.iter().all(|c| c.matches(labels))
}

impl fmt::Display for LabelConstraint {
    /// The selector syntax it was parsed from: `"key": "!in(a,b)"`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let value = match &self.op {
            LabelOp::In(v) if v.len() == 1 => v[0].clone(),
            LabelOp::NotIn(v) if v.len() == 1 => format!("!{}", v[0]),
            LabelOp::In(v) => format!("in({})", v.join(",")),
            LabelOp::NotIn(v) => format!("!in({})", v.join(",")),
            LabelOp::Exists => String::new(),
            LabelOp::DoesNotExist => "!".to_string(),
        };
        write!(f, "{:?}: {value:?}", self.key)
    }
}

/// Formats a selector as `{"key": "value", ...}` for messages.
pub fn format_label_selector(selector: &[LabelConstraint]) -> String {
    let parts: Vec<String> = selector.iter().map(|c| c.to_string()).collect();
    format!("{{{}}}", parts.join(", "))
}

/// Parses a Ray 2.x label selector map. Values: `"v"` equals, `"!v"` not equals (absent
/// matches), `"in(a,b)"`, `"!in(a,b)"`; our extensions: `""` exists, `"!"` does not exist.
/// Errors: an empty key, an empty or malformed `in(...)` list.
pub fn parse_label_selector(
    map: &BTreeMap<String, String>,
) -> Result<Vec<LabelConstraint>, LabelError> {
    map.iter()
        .map(|(key, value)| {
            if key.trim().is_empty() {
                return Err(LabelError::EmptySelectorKey(value.clone()));
            }
            let bad = || LabelError::InvalidSelector { key: key.clone(), value: value.clone() };
            let v = value.trim();
            let (negated, rest) = match v.strip_prefix('!') {
                Some(rest) => (true, rest.trim()),
                None => (false, v),
            };
            let op = if rest.is_empty() {
                if negated { LabelOp::DoesNotExist } else { LabelOp::Exists }
            } else if let Some(list) = rest.strip_prefix("in(") {
                let list = list.strip_suffix(')').ok_or_else(bad)?;
                let vals: Vec<String> = list.split(',').map(|s| s.trim().to_string()).collect();
                if vals.iter().any(|s| s.is_empty() || s.contains(['(', ')'])) {
                    return Err(bad());
                }
                if negated { LabelOp::NotIn(vals) } else { LabelOp::In(vals) }
            } else if rest.contains(['(', ')']) {
                return Err(bad());
            } else if negated {
                LabelOp::NotIn(vec![rest.to_string()])
            } else {
                LabelOp::In(vec![rest.to_string()])
            };
            Ok(LabelConstraint { key: key.trim().to_string(), op })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sel(pairs: &[(&str, &str)]) -> Result<Vec<LabelConstraint>, LabelError> {
        parse_label_selector(&pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect())
    }

    #[test]
    fn label_strings_parse_or_name_the_bad_pair() {
        let ok = Labels::parse(" zone = a ,tpuray.io/tpu-worker-id=0,x=").unwrap();
        assert_eq!(ok.get("zone"), Some("a"));
        assert_eq!(ok.get("x"), Some(""));
        assert_eq!(Labels::parse(""), Ok(Labels::default()));
        let cases = [
            ("abc", r#"invalid label "abc" (expected key=value)"#),
            ("a=1,,b=2", r#"invalid label "" (expected key=value)"#),
            ("=v", r#"invalid label "=v" has an empty key (expected key=value)"#),
            ("a=1,a=2", r#"duplicate label key "a" (each key may appear once)"#),
        ];
        for (s, want) in cases {
            assert_eq!(Labels::parse(s).unwrap_err().to_string(), want, "{s}");
        }
    }

    #[test]
    fn selector_ops_match_like_ray() {
        let node = Labels::parse("zone=a,tier=gold").unwrap();
        // (selector key, value, matches `node`)
        let cases = [
            ("zone", "a", true),
            ("zone", "b", false),
            ("zone", "!a", false),
            ("zone", "!b", true),
            ("missing", "!b", true),
            ("missing", "b", false),
            ("zone", "in(b, a)", true),
            ("zone", "in(b,c)", false),
            ("zone", "!in(b,c)", true),
            ("zone", "!in(a,c)", false),
            ("zone", "", true),
            ("missing", "", false),
            ("missing", "!", true),
            ("zone", "!", false),
        ];
        for (k, v, want) in cases {
            let s = sel(&[(k, v)]).unwrap();
            assert_eq!(selector_matches(&s, &node), want, "{k}: {v}");
        }
    }

    /// SCHED-8: label keys `ray.io/K` and `tpuray.io/K` are aliases.
    #[test]
    fn ray_and_tpuray_prefixes_are_aliases_sched_8() {
        let tpuray_node = Labels::parse("tpuray.io/tpu-slice-name=s1").unwrap();
        let ray_node = Labels::parse("ray.io/tpu-slice-name=s1").unwrap();
        for node in [&tpuray_node, &ray_node] {
            for key in ["ray.io/tpu-slice-name", "tpuray.io/tpu-slice-name"] {
                assert!(selector_matches(&sel(&[(key, "s1")]).unwrap(), node), "{key}");
                assert!(!selector_matches(&sel(&[(key, "!s1")]).unwrap(), node), "{key}");
            }
        }
        assert_eq!(ray_node.get("tpuray.io/tpu-slice-name"), Some("s1"));
    }

    #[test]
    fn malformed_selectors_are_rejected_naming_key_and_value() {
        for v in ["in(a", "in()", "in(a,,b)", "!in(", "a)"] {
            let err = sel(&[("zone", v)]).unwrap_err();
            assert_eq!(err, LabelError::InvalidSelector { key: "zone".into(), value: v.into() });
        }
        assert!(sel(&[("", "a")]).unwrap_err().to_string().contains("empty key"));
    }

    #[test]
    fn selector_display_round_trips_through_parse() {
        let s = sel(&[
            ("a", "x"),
            ("b", "!y"),
            ("c", "in(1,2)"),
            ("d", "!in(3,4)"),
            ("e", ""),
            ("f", "!"),
        ])
        .unwrap();
        let shown = format_label_selector(&s);
        assert_eq!(
            shown,
            r#"{"a": "x", "b": "!y", "c": "in(1,2)", "d": "!in(3,4)", "e": "", "f": "!"}"#
        );
        let back: BTreeMap<String, String> = serde_json::from_str(&shown).unwrap();
        assert_eq!(parse_label_selector(&back).unwrap(), s);
    }
}
