//! ARCHITECTURE.md's numbered invariants are written where they are kept and where they
//! are checked (STYLE.md: "write the number in a comment at the code that enforces it
//! and in the name or doc of the test that checks it"): every tag the map names
//! (`CORE-2`, `AGENT-11`, `OBJ-8`, ...) appears in the product's code, and in a test's
//! name or doc (`core9_...`, `..._sched_5`, or the tag itself in a test file or a
//! `#[cfg(test)]` module), except the few listed in [`NO_TEST_YET`] with what a test
//! would assert.
//! Reads files only; starts nothing.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Invariants no test checks yet, each with what such a test would assert. A tag leaves
/// this list when a test for it is written (this test then says so).
const NO_TEST_YET: &[(&str, &str)] = &[
    (
        "AGENT-8",
        "more workers started at once than the node has CPUs: never more than that many \
         starting at any moment, and a waiting lease takes an idle worker when one frees",
    ),
    (
        "HEAD-1",
        "a head that took heartbeats, resource reports and lease demand, then restarts from \
         its log, holds the same durable records and logged no command for that soft state",
    ),
    (
        "HEAD-5",
        "one agent's PrepareBundles or commit fails partway through a group: the group is \
         not recorded placed, every bundle the attempt reserved is returned, it stays waiting",
    ),
    (
        "PG-3",
        "waiting for a batch of groups one after another asks the head a few times, not \
         once per group (a count of GetPlacementGroup calls)",
    ),
];

/// Words of the form of a tag that are not invariants (a hash's name).
const NOT_TAGS: &[&str] = &["SHA-1"];

/// The folders that hold the product and its tests (build outputs and venvs excluded).
const SOURCES: &[&str] = &[
    "bench",
    "cli",
    "examples",
    "head",
    "objectstore",
    "proto",
    "python-sdk/python",
    "python-sdk/src",
    "python-sdk/tests",
    "replica",
    "scheduler",
    "sdk",
    "tests",
    "worker",
];

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the repository root").to_path_buf()
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let p = e.path();
        let name = e.file_name().to_string_lossy().to_string();
        if p.is_dir() {
            if !(name == "target" || name.starts_with('.') || name == "__pycache__") {
                walk(&p, out);
            }
        } else if name.ends_with(".rs") || name.ends_with(".py") {
            out.push(p);
        }
    }
}

/// The tags ARCHITECTURE.md names: one or two upper-case words, a dash, a number
/// (`CORE-2`, `SERVE-API-1`).
fn tags(text: &str) -> BTreeSet<String> {
    let re = regex::Regex::new(r"(?m)(?:^|[^A-Za-z0-9-])([A-Z]{2,9}(?:-[A-Z]{2,9})?-[0-9]{1,2})\b")
        .unwrap();
    re.captures_iter(text)
        .map(|c| c[1].to_string())
        .filter(|t| !NOT_TAGS.contains(&t.as_str()))
        .collect()
}

/// What finds `tag` in test code: the tag itself (`CORE-9`, in a test's doc or comment),
/// or the tag as a word of a test function's name (`fn core9_...`, `def test_..._sched_5`).
/// A variable or a path that happens to read like one (`pg3`, `head1`) does not count.
fn test_pattern(tag: &str) -> regex::Regex {
    let (word, n) = tag.rsplit_once('-').unwrap();
    let w = word.to_lowercase().replace('-', "_");
    regex::Regex::new(&format!(
        r"(?:(?:^|[^A-Za-z0-9-]){tag}(?:[^0-9]|$)|(?:fn|def)\s+(?:\w*_)?{w}_?{n}(?:_\w*)?\s*[(<])"
    ))
    .unwrap()
}

#[test]
fn every_numbered_invariant_is_written_at_its_code_and_its_test() {
    let root = repo();
    let map = std::fs::read_to_string(root.join("ARCHITECTURE.md")).unwrap();
    let tags = tags(&map);
    assert!(tags.len() > 50, "ARCHITECTURE.md names {} tags; expected the map's", tags.len());
    let mut files = Vec::new();
    for s in SOURCES {
        walk(&root.join(s), &mut files);
    }
    // This file names tags in NO_TEST_YET: it is the check, not a test of them.
    let me = root.join(file!());
    files.retain(|f| *f != me);
    let patterns: Vec<(&String, regex::Regex)> =
        tags.iter().map(|t| (t, test_pattern(t))).collect();
    let mut at_code: BTreeMap<&str, usize> = BTreeMap::new();
    let mut at_test: BTreeMap<&str, usize> = BTreeMap::new();
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap_or_default();
        let rel = f.strip_prefix(&root).unwrap().to_string_lossy().to_string();
        let name = f.file_name().unwrap().to_string_lossy().to_string();
        let test_file = rel.contains("/tests/")
            || rel.starts_with("tests/")
            || name.starts_with("test_")
            || name == "tests.rs"
            || name.ends_with("_tests.rs");
        let (code, test) = match (test_file, text.find("#[cfg(test)]")) {
            (true, _) => ("", text.as_str()),
            (false, Some(i)) if name.ends_with(".rs") => text.split_at(i),
            (false, _) => (text.as_str(), ""),
        };
        for (t, pattern) in &patterns {
            if code.contains(t.as_str()) {
                *at_code.entry(t).or_default() += 1;
            }
            if !test.is_empty() && pattern.is_match(test) {
                *at_test.entry(t).or_default() += 1;
            }
        }
    }
    let no_test: BTreeMap<&str, &str> = NO_TEST_YET.iter().copied().collect();
    let missing_code: Vec<&String> =
        tags.iter().filter(|t| !at_code.contains_key(t.as_str())).collect();
    let missing_test: Vec<&String> = tags
        .iter()
        .filter(|t| !at_test.contains_key(t.as_str()) && !no_test.contains_key(t.as_str()))
        .collect();
    let tested_now: Vec<&&str> = no_test.keys().filter(|t| at_test.contains_key(**t)).collect();
    assert!(
        missing_code.is_empty(),
        "invariants ARCHITECTURE.md names that no code comment carries: {missing_code:?}"
    );
    assert!(
        missing_test.is_empty(),
        "invariants ARCHITECTURE.md names that no test's name or doc carries: {missing_test:?} \
         (label the test that checks each, or list it in NO_TEST_YET with what a test would assert)"
    );
    assert!(tested_now.is_empty(), "tested now, so no longer NO_TEST_YET: {tested_now:?}");
}
