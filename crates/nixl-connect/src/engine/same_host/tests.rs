//! The wing's layout, checked: every file sits in a layer, and imports only from layers below
//! its own, so no import circle can form between the owners (nor between the files of the wing's
//! part of the floor, `sys/same_host/`, read here as the wing's `sys/`). Read from the source tree at test
//! time: a new file with no layer fails here.

use std::collections::BTreeMap;
use std::path::Path;

/// Each module of the wing and its layer (lower: nearer the metal and the wire). The coordinator
/// (`transport`, one `impl SameHostTransport` and its `Transport` impl) sits above every owner.
const LAYERS: &[(&str, u8)] = &[
    // The wing's part of the floor (`src/sys/same_host/`), below every module of the wing.
    ("sys/closer", 0),
    ("sys/slots", 0),
    ("sys/mem", 0),
    ("sys/dir", 0),
    ("sys/ipc_error", 0),
    ("sys/cma", 1),
    ("sys/vmm", 1),
    ("sys", 2),
    ("sys/pipe", 2),
    ("sys/staged", 2),
    ("sys/ipc", 3),
    // The wing.
    ("limits", 4),
    ("auth", 4),
    ("violation", 4),
    ("identity", 5),
    ("wire", 6),
    ("link", 7),
    ("conn", 8),
    ("records", 8),
    ("server_book", 9),
    ("client_book", 9),
    ("in_flight", 9),
    ("feeds", 9),
    ("sockets", 9),
    ("policy", 10),
    ("eager", 10),
    ("device", 10),
    ("transport", 11),
];

/// The module a source file belongs to (tests and nested files count as their parent's).
fn module_of(rel: &str) -> String {
    let rel = rel.trim_end_matches(".rs").trim_end_matches("/mod");
    let mut parts = rel.split('/');
    let first = parts.next().unwrap_or_default();
    match (first, parts.next()) {
        ("sys", Some(sub)) if sub != "mod" => format!("sys/{sub}"),
        (first, _) => first.to_string(),
    }
}

/// The wing's modules that the file at `rel` (its path in the wing) names, read with the crate's
/// layer check's parser (`use` trees, `crate::`, `super::` and `self::` paths, outside comments
/// and test modules).
fn imports(code: &str, rel: &str) -> Vec<String> {
    let mut me: Vec<&str> = rel.trim_end_matches(".rs").split('/').collect();
    if me.last() == Some(&"mod") {
        me.pop();
    }
    let mut out = Vec::new();
    for p in crate::layers::paths_in(&crate::layers::code_of(code)) {
        let p: Vec<&str> = p.iter().map(String::as_str).collect();
        let rest: Vec<&str> = match p.first().copied() {
            Some("crate") if p.get(1..3) == Some(&["engine", "same_host"][..]) => p[3..].to_vec(),
            // The wing's part of the floor, read as the wing's `sys/`.
            Some("crate") if p.get(1..3) == Some(&["sys", "same_host"][..]) => {
                std::iter::once("sys").chain(p[3..].iter().copied()).collect()
            }
            Some("super") => {
                let up = p.iter().take_while(|s| **s == "super").count();
                if up > me.len() {
                    continue; // above the wing
                }
                me[..me.len() - up].iter().chain(&p[up..]).copied().collect()
            }
            Some("self") => me.iter().chain(&p[1..]).copied().collect(),
            _ => continue,
        };
        let name = match rest.as_slice() {
            [] => continue,
            ["sys", sub, ..] if LAYERS.iter().any(|(m, _)| *m == format!("sys/{sub}")) => {
                format!("sys/{sub}")
            }
            [first, ..] => first.to_string(),
        };
        out.push(name);
    }
    out
}

/// The wing's source files, and those of its part of the floor (`src/sys/same_host/`) as the
/// wing's `sys/` (every import in them goes down a layer; the file a test lives in is not held to
/// it).
fn wing_files() -> Vec<(String, String)> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = crate::layers::rust_files(&src.join("engine/same_host"));
    files.extend(
        crate::layers::rust_files(&src.join("sys/same_host"))
            .into_iter()
            .map(|(rel, code)| (format!("sys/{rel}"), code)),
    );
    files
}

/// Every import in `files` that does not go down a layer, and how many imports were checked.
fn upward(files: &[(String, String)]) -> (Vec<String>, usize) {
    let layer: BTreeMap<&str, u8> = LAYERS.iter().copied().collect();
    let (mut found, mut checked) = (Vec::new(), 0);
    for (rel, code) in files {
        let name = rel.rsplit('/').next().unwrap_or_default();
        if rel == "mod.rs" || name == "tests.rs" || name == "fuzz.rs" {
            continue;
        }
        let m = module_of(rel);
        let Some(&own) = layer.get(m.as_str()) else {
            found.push(format!(
                "{rel}: module `{m}` has no layer in LAYERS (give it one)"
            ));
            continue;
        };
        for t in imports(code, rel) {
            if t == m || t == "*" || t.is_empty() || (m.starts_with("sys") && t == "sys") {
                continue;
            }
            let Some(&theirs) = layer.get(t.as_str()) else {
                continue; // a name of this module's own children (`self::`), or an item of `super`
            };
            checked += 1;
            if theirs >= own {
                found.push(format!(
                    "{rel}: `{m}` (layer {own}) imports `{t}` (layer {theirs}): not below it"
                ));
            }
        }
    }
    (found, checked)
}

#[test]
fn same_host_owners_import_only_downward() {
    let (found, checked) = upward(&wing_files());
    assert!(found.is_empty(), "{}", found.join("\n"));
    assert!(
        checked > 50,
        "only {checked} imports checked: the parser lost them"
    );
}

/// The check sees an import inside a `use` tree: the staged copies naming the direct CUDA IPC
/// path above them (the circle `ipc` <-> `staged` the wing once had) fails it.
#[test]
fn same_host_a_planted_upward_import_in_a_use_tree_fails() {
    let mut files = wing_files();
    files.push(("sys/staged.rs".into(), "use super::{cma, ipc};\n".into()));
    let (found, _) = upward(&files);
    assert!(
        found
            .iter()
            .any(|f| f.starts_with("sys/staged.rs") && f.contains("`sys/ipc`")),
        "the planted import was not seen: {found:?}"
    );
}

/// The wing may move to the thread of a caller that waits (a small operation's waiter drives the
/// engine: docs/decisions/0005-who-drives.md), so the transport must be `Send`; the NIXL transport's raw
/// handles are what keep the whole engine core on its thread. A field that is not `Send` fails
/// to compile here, where the reason is written down.
#[test]
fn same_host_transport_can_move_to_a_waiting_callers_thread() {
    fn movable<T: Send>() {}
    movable::<super::SameHostTransport>();
}
