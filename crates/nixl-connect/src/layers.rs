//! The crate's layout, checked: every module sits in a layer (the public API over the engine,
//! over the transports, over the seam between them, over the values every layer shares, over
//! the floor), imports only from its own layer or below, and no two of the modules listed here
//! import each other, directly or around a circle (a listed module's files count as one). Read
//! from the source tree at test time, from the `crate::`, `super::` and `self::` paths each file
//! names (outside comments and test modules): a new module with no layer fails here. The same-host wing, one module here, checks its own inside
//! (`engine/same_host/tests.rs`, with this file's parser).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Each module and its layer (higher: nearer the user). A module not listed takes the layer of
/// the nearest listed module above it in the tree (`engine/nixl/ffi` is `engine/nixl`'s).
const LAYERS: &[(&str, u8)] = &[
    // The crate's root re-exports the API; this check reads every layer.
    ("", 6),
    ("layers", 6),
    // The API: what a user holds.
    ("connector", 5),
    ("operation", 5),
    ("path_probe", 5),
    ("channel", 5),
    ("metrics", 5),
    ("metrics/http", 5),
    // The engine: its thread, its core, who waits how.
    ("engine", 4),
    ("engine/core", 4),
    ("engine/driver", 4),
    ("engine/wait", 4),
    // The transports.
    ("engine/nixl", 3),
    ("engine/same_host", 3),
    ("engine/loopback", 3),
    // The seam between the engine and the transports: the trait, the commands and their
    // mailboxes, the poller both sides register with.
    ("engine/transport", 2),
    ("engine/cmd", 2),
    ("engine/poller", 2),
    // The values every layer shares.
    ("state", 1),
    ("stats", 1),
    ("metadata", 1),
    ("decline_reason", 1),
    ("descriptor", 1),
    ("registration", 1),
    ("buffer", 1),
    ("cuda", 1),
    ("metrics/families", 1),
    ("metrics/engine", 1),
    // The floor (every syscall, every CUDA driver call but NIXL's: `sys`), with the plain values
    // and helpers it shares with every layer above.
    ("error", 0),
    ("device", 0),
    ("reg", 0),
    ("ipc_source", 0),
    ("sync", 0),
    ("settings", 0),
    ("pace", 0),
    ("sys", 0),
];

/// The module path of a file under `src/` (`engine/nixl/mod.rs` -> `engine/nixl`).
fn module_of(rel: &str) -> Vec<String> {
    let mut parts: Vec<String> = rel
        .trim_end_matches(".rs")
        .split('/')
        .map(str::to_owned)
        .collect();
    if parts.last().is_some_and(|p| p == "mod" || p == "lib") {
        parts.pop();
    }
    parts
}

/// The listed module a path falls in: the longest listed prefix.
fn key_of(path: &[String]) -> &'static str {
    (0..=path.len())
        .rev()
        .find_map(|n| {
            let k = path[..n].join("/");
            LAYERS.iter().find(|(m, _)| *m == k).map(|(m, _)| *m)
        })
        .unwrap_or("")
}

fn layer_of(key: &str) -> u8 {
    LAYERS.iter().find(|(m, _)| *m == key).map_or(6, |(_, l)| *l)
}

/// The code of a file that counts: no comment lines, nothing from its inline test module
/// (`mod tests {`) on; a `mod tests;` declaration names a file of its own, read (or left out)
/// as such.
pub(crate) fn code_of(src: &str) -> String {
    let mut out = String::new();
    for line in src.lines() {
        let t = line.trim_start();
        if t.starts_with("//") {
            continue;
        }
        let t = t.trim_start_matches("#[cfg(test)]").trim_start();
        let t = t
            .trim_start_matches("pub(crate) ")
            .trim_start_matches("pub(super) ");
        if t.starts_with("mod tests {") {
            break;
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// The paths of a `use` tree (`a::{b, c::D as E}` -> `a::b`, `a::c::D as E`: an alias stays on
/// its last segment).
fn expand(tree: &str) -> Vec<Vec<String>> {
    let tree = tree.trim();
    let Some(open) = tree.find('{') else {
        return vec![tree
            .split("::")
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect()];
    };
    let prefix: Vec<String> = tree[..open]
        .split("::")
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect();
    let Some(inner) = tree.rfind('}').and_then(|close| tree.get(open + 1..close)) else {
        return Vec::new(); // not a `use` tree (text that reads "use ... {")
    };
    let (mut parts, mut depth, mut cur) = (Vec::new(), 0i32, String::new());
    for c in inner.chars() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            _ => {}
        }
        if c == ',' && depth == 0 {
            parts.push(std::mem::take(&mut cur));
        } else {
            cur.push(c);
        }
    }
    parts.push(cur);
    parts
        .iter()
        .filter(|p| !p.trim().is_empty())
        .flat_map(|p| expand(p))
        .map(|tail| prefix.iter().cloned().chain(tail).collect())
        .collect()
}

/// Every path `code` names from `crate`, `super` or `self`.
pub(crate) fn paths_in(code: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find("use ") {
        let before = rest[..at].chars().next_back();
        let after = &rest[at + 4..];
        if before.is_none_or(|c| !(c.is_alphanumeric() || c == '_')) {
            if let Some(end) = after.find(';') {
                out.extend(expand(&after[..end]).into_iter().map(|mut p| {
                    if let Some(last) = p.last_mut() {
                        *last = last.split(" as ").next().unwrap_or_default().to_owned();
                    }
                    p
                }));
            }
        }
        rest = after;
    }
    for root in ["crate::", "super::", "self::"] {
        for (at, _) in code.match_indices(root) {
            let before = code[..at].chars().next_back();
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                continue;
            }
            let path: String = code[at..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
                .collect();
            if code[at + path.len()..].starts_with('{') {
                continue; // a `use` tree's head: its paths came whole from the tree above
            }
            out.push(
                path.split("::")
                    .filter(|s| !s.is_empty())
                    .map(str::to_owned)
                    .collect(),
            );
        }
    }
    out
}

/// The names the crate's root re-exports, each with the module path it comes from.
fn reexports(lib: &str) -> BTreeMap<String, Vec<String>> {
    let mut out = BTreeMap::new();
    let code = code_of(lib);
    let mut rest = code.as_str();
    while let Some(at) = rest.find("pub use ") {
        let after = &rest[at + 8..];
        if let Some(end) = after.find(';') {
            for mut p in expand(&after[..end]) {
                let last = p.pop().unwrap_or_default();
                let name = last.rsplit(" as ").next().unwrap_or_default().trim().to_owned();
                out.insert(name, p);
            }
        }
        rest = after;
    }
    out
}

/// Every import that runs up a layer, and every circle between modules, in `files` (paths
/// under `src/` and their text).
fn violations(files: &[(String, String)]) -> (Vec<String>, usize) {
    let lib = files.iter().find(|(r, _)| r == "lib.rs").map_or("", |(_, c)| c);
    let roots = reexports(lib);
    let mut edges: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    let mut found = Vec::new();
    let mut checked = 0;
    for (rel, src) in files {
        let name = rel.rsplit('/').next().unwrap_or_default();
        if name == "tests.rs" || name == "fuzz.rs" || rel.contains("/tests/") {
            continue;
        }
        let me = module_of(rel);
        let own = key_of(&me);
        for p in paths_in(&code_of(src)) {
            let target: Vec<String> = match p.first().map(String::as_str) {
                Some("crate") => match p.get(1).and_then(|n| roots.get(n)) {
                    Some(from) => from.iter().chain(&p[2..]).cloned().collect(),
                    None => p[1..].to_vec(),
                },
                Some("super") => {
                    let up = p.iter().take_while(|s| *s == "super").count();
                    me[..me.len().saturating_sub(up)]
                        .iter()
                        .chain(&p[up..])
                        .cloned()
                        .collect()
                }
                Some("self") => me.iter().chain(&p[1..]).cloned().collect(),
                _ => continue,
            };
            let theirs = key_of(&target);
            if theirs == own {
                continue;
            }
            checked += 1;
            if layer_of(theirs) > layer_of(own) {
                found.push(format!(
                    "{rel}: `{own}` (layer {}) imports `{}` from `{theirs}` (layer {}): up a layer",
                    layer_of(own),
                    p.join("::"),
                    layer_of(theirs)
                ));
            }
            edges.entry(own).or_default().insert(theirs);
        }
    }
    // A circle: a module that reaches itself.
    for &start in edges.keys() {
        let (mut seen, mut todo) = (BTreeSet::new(), vec![start]);
        while let Some(m) = todo.pop() {
            for &n in edges.get(m).into_iter().flatten() {
                if n == start {
                    found.push(format!("`{start}` imports itself around a circle through `{m}`"));
                } else if seen.insert(n) {
                    todo.push(n);
                }
            }
        }
    }
    (found, checked)
}

/// Every `.rs` file under `dir`, by its path relative to `dir`, with its text (the wing's own
/// layout check reads its folder the same way).
pub(crate) fn rust_files(dir: &Path) -> Vec<(String, String)> {
    fn walk(dir: &Path, base: &Path, files: &mut Vec<(String, String)>) {
        for e in std::fs::read_dir(dir).expect("a source folder") {
            let p = e.expect("an entry").path();
            if p.is_dir() {
                walk(&p, base, files);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let rel = p
                    .strip_prefix(base)
                    .expect("inside")
                    .to_string_lossy()
                    .into_owned();
                files.push((rel, std::fs::read_to_string(&p).expect("readable")));
            }
        }
    }
    let mut files = Vec::new();
    walk(dir, dir, &mut files);
    files
}

fn crate_files() -> Vec<(String, String)> {
    rust_files(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"))
}

#[test]
fn layers_every_import_runs_down_and_none_circles() {
    let files = crate_files();
    let (found, checked) = violations(&files);
    assert!(found.is_empty(), "{}", found.join("\n"));
    assert!(
        checked > 300,
        "only {checked} imports checked: the parser lost them"
    );
}

#[test]
fn layers_every_module_has_a_layer() {
    for (rel, _) in crate_files() {
        let me = module_of(&rel);
        let top = me.first().map_or("", String::as_str);
        assert!(
            me.is_empty() || LAYERS.iter().any(|(m, _)| *m == top),
            "{rel}: module `{top}` has no layer in LAYERS (give it one)"
        );
    }
}

/// The check fails on an upward import planted in the tree: a transport that names the API.
#[test]
fn layers_a_planted_upward_import_fails() {
    let mut files = crate_files();
    files.push((
        "engine/nixl/planted.rs".into(),
        "use crate::connector::ConnectorBuilder;\n".into(),
    ));
    let (found, _) = violations(&files);
    assert!(
        found.iter().any(|f| f.starts_with("engine/nixl/planted.rs")),
        "the planted import was not seen: {found:?}"
    );
}

/// The check fails on a circle planted between two modules of one layer.
#[test]
fn layers_a_planted_circle_fails() {
    let mut files = crate_files();
    files.push(("reg/planted.rs".into(), "use crate::state::OpState;\n".into()));
    files.push(("state/planted.rs".into(), "use crate::reg::Range;\n".into()));
    let (found, _) = violations(&files);
    assert!(
        found.iter().any(|f| f.contains("circle")),
        "the planted circle was not seen: {found:?}"
    );
}

/// Re-exports at the root resolve to the module they come from, and `use` trees expand.
#[test]
fn layers_paths_resolve_through_trees_and_reexports() {
    let paths = paths_in("use super::{a::B, c};\nlet x = crate::engine::transport::small(r);\n");
    // A grouped import over lines names its paths, not the bare root its group hangs from.
    let grouped = paths_in("use crate::{\n    error::{Error, Result},\n    metadata::RdmaMetadata,\n};\n");
    assert!(grouped.contains(&vec!["crate".into(), "error".into(), "Result".into()]));
    assert!(grouped.contains(&vec!["crate".into(), "metadata".into(), "RdmaMetadata".into()]));
    assert!(grouped.iter().all(|p| p.len() > 1), "{grouped:?}");
    assert!(paths.contains(&vec!["super".into(), "a".into(), "B".into()]));
    assert!(paths.contains(&vec!["super".into(), "c".into()]));
    assert!(paths.contains(&vec![
        "crate".into(),
        "engine".into(),
        "transport".into(),
        "small".into()
    ]));
    let roots = reexports("pub use engine::transport::{small, X as Y};\n");
    assert_eq!(
        roots.get("Y"),
        Some(&vec!["engine".to_string(), "transport".to_string()])
    );
}
