//! The wing's layout, checked: every file sits in a layer, and imports only from layers below
//! its own (or, for the transport's job files, beside it), so no import circle can form between
//! the owners. Read from the source tree at test time: a new file with no layer fails here.

use std::collections::BTreeMap;
use std::path::Path;

/// Each module of the wing and its layer (lower: nearer the metal and the wire). The job files
/// (layer 8) are `impl SameHostTransport` blocks: one owner, the transport's actions.
const LAYERS: &[(&str, u8)] = &[
    ("limits", 0),
    ("auth", 0),
    ("violation", 0),
    ("identity", 1),
    ("wire", 2),
    ("link", 3),
    ("sys", 3),
    ("sys/slots", 1),
    ("sys/cma", 2),
    ("sys/mem", 1),
    ("sys/dir", 1),
    ("sys/pipe", 3),
    ("sys/vmm", 2),
    ("sys/ipc_error", 1),
    ("sys/ipc", 4),
    ("sys/staged", 3),
    ("records", 5),
    ("server_book", 6),
    ("client_book", 6),
    ("in_flight", 6),
    ("feeds", 6),
    ("sockets", 6),
    ("policy", 7),
    ("eager", 7),
    ("transport", 8),
    ("conn", 9),
    ("client", 9),
    ("server", 9),
    ("dispatch", 9),
    ("copies", 9),
    ("device", 9),
    ("seam", 9),
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

/// The wing's modules that `code` names (outside comments and test modules).
fn imports(code: &str, within_sys: bool) -> Vec<String> {
    let mut out = Vec::new();
    for line in code.lines() {
        let line = line.trim_start();
        if line.starts_with("//") {
            continue;
        }
        if line.starts_with("mod tests") || line.starts_with("pub(crate) mod fuzz") {
            break;
        }
        for root in ["crate::engine::same_host::", "super::"] {
            for (at, _) in line.match_indices(root) {
                let rest = &line[at + root.len()..];
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                let name = if name == "sys" {
                    let sub: String = rest["sys::".len().min(rest.len())..]
                        .chars()
                        .take_while(|c| c.is_alphanumeric() || *c == '_')
                        .collect();
                    if LAYERS.iter().any(|(m, _)| *m == format!("sys/{sub}")) {
                        format!("sys/{sub}")
                    } else {
                        "sys".into()
                    }
                } else if within_sys
                    && root == "super::"
                    && LAYERS.iter().any(|(m, _)| *m == format!("sys/{name}"))
                {
                    format!("sys/{name}")
                } else {
                    name
                };
                out.push(name);
            }
        }
    }
    out
}

/// Every import in the wing goes down a layer (job files may also use each other's helpers);
/// the file a test lives in is not held to it.
#[test]
fn same_host_owners_import_only_downward() {
    let files =
        crate::layers::rust_files(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src/engine/same_host"));
    let layer: BTreeMap<&str, u8> = LAYERS.iter().copied().collect();
    let mut checked = 0;
    for (rel, code) in &files {
        let name = rel.rsplit('/').next().unwrap_or_default();
        if rel == "mod.rs" || name == "tests.rs" || name == "fuzz.rs" {
            continue;
        }
        let m = module_of(rel);
        let Some(&own) = layer.get(m.as_str()) else {
            panic!("{rel}: module `{m}` has no layer in LAYERS (give it one)");
        };
        for t in imports(code, m.starts_with("sys")) {
            if t == m || t == "*" || t.is_empty() || (m.starts_with("sys") && t == "sys") {
                continue;
            }
            let Some(&theirs) = layer.get(t.as_str()) else {
                continue; // a name of this module's own children (`self::`), or an item of `super`
            };
            checked += 1;
            assert!(
                theirs < own || (own == 9 && theirs == 9),
                "{rel}: `{m}` (layer {own}) imports `{t}` (layer {theirs}): not below it"
            );
        }
    }
    assert!(
        checked > 50,
        "only {checked} imports checked: the parser lost them"
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
