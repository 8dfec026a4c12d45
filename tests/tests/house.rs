//! House rules of the code (issue 14), checked rather than promised:
//! - no import cycle between the modules of `crates/outboxd` or `crates/bench`;
//! - no file of the relay (`crates/outboxd/src/relay`) over 500 lines before its tests, and no
//!   file of `crates/outboxd/src` over 550 (the files still over it are listed; the list only
//!   shrinks: issue 41 empties it);
//! - the library exposes only what other crates use;
//! - no new pair of top-level modules of `crates/outboxd/src` importing each other (the pairs
//!   that still do are listed, and the list only shrinks: issue 41 empties it).
//!
//! Modules are files; an edge is a `crate::…` path in a file's code (comments and the
//! `#[cfg(test)] mod tests` block are skipped). A child module naming its parent is not an edge
//! (Rust modules see their ancestors); everything else must form a DAG.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// `src/a/b.rs` → `a::b`, `src/a/mod.rs` → `a`, `src/lib.rs` → `` (the crate root).
fn module_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if parts.last().is_some_and(|l| l == "mod") {
        parts.pop();
    }
    if parts.len() == 1 && (parts[0] == "lib" || parts[0] == "main") {
        parts.clear();
    }
    parts.join("::")
}

/// The code of a file without comments and without its unit-test module.
fn code(text: &str) -> String {
    let text = text.split("#[cfg(test)]\nmod tests").next().unwrap_or(text);
    text.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Every `crate::x::y` path in `code`, `crate::{a::b, c}` groups expanded.
fn crate_paths(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    for (i, _) in code.match_indices("crate::") {
        let rest = &code[i + 7..];
        if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            for item in group[..end].split(',') {
                let item: String = item.trim().chars().take_while(|&c| ident(c)).collect();
                out.push(item);
            }
        } else {
            out.push(rest.chars().take_while(|&c| ident(c)).collect());
        }
    }
    out
}

/// Every `super::…` and `self::…` path in the code of module `m`, as the `crate::` path it
/// names: `self` is `m`, `super` its parent (`super::super::x` climbs twice). A file's module
/// is its path (`a/b.rs` and `a/b/mod.rs` are both `a::b`), so one rule serves both.
fn relative_paths(code: &str, m: &str) -> Vec<String> {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let mut out = Vec::new();
    let segs: Vec<&str> = if m.is_empty() {
        vec![]
    } else {
        m.split("::").collect()
    };
    for start in ["super::", "self::"] {
        for (i, _) in code.match_indices(start) {
            // Not the tail of a longer name (`my_super::`) nor a `super::` of a `super::super::`.
            let before = code[..i].chars().next_back();
            if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':') {
                continue;
            }
            let mut rest = &code[i..];
            let mut up = 0;
            if start == "self::" {
                rest = &rest["self::".len()..];
            } else {
                while let Some(r) = rest.strip_prefix("super::") {
                    up += 1;
                    rest = r;
                }
            }
            if up > segs.len() {
                continue;
            }
            let base = segs[..segs.len() - up].join("::");
            let mut items = Vec::new();
            if let Some(group) = rest.strip_prefix('{') {
                let end = group.find('}').unwrap_or(group.len());
                for item in group[..end].split(',') {
                    items.push(
                        item.trim()
                            .chars()
                            .take_while(|&c| ident(c))
                            .collect::<String>(),
                    );
                }
            } else {
                items.push(rest.chars().take_while(|&c| ident(c)).collect());
            }
            for item in items {
                let item = item.trim_end_matches(':').to_string();
                if item.is_empty() || item == "self" {
                    continue;
                }
                out.push(if base.is_empty() {
                    item
                } else {
                    format!("{base}::{item}")
                });
            }
        }
    }
    out
}

/// Module → modules it names, for the crate whose sources are in `src`.
fn graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let modules: BTreeMap<String, PathBuf> = files
        .iter()
        .map(|f| (module_of(src, f), f.clone()))
        .collect();
    let resolve = |path: &str| -> Option<String> {
        let segs: Vec<&str> = path.trim_end_matches(':').split("::").collect();
        (1..=segs.len())
            .rev()
            .map(|n| segs[..n].join("::"))
            .find(|m| modules.contains_key(m))
    };
    let mut g = BTreeMap::new();
    for (m, f) in &modules {
        let text = std::fs::read_to_string(f).unwrap();
        let mut to = BTreeSet::new();
        let code = code(&text);
        let mut paths = crate_paths(&code);
        paths.extend(relative_paths(&code, m));
        for p in paths {
            if let Some(t) = resolve(&p) {
                let ancestor = m.starts_with(&format!("{t}::"));
                if t != *m && !t.is_empty() && !ancestor {
                    to.insert(t);
                }
            }
        }
        g.insert(m.clone(), to);
    }
    g
}

/// Strongly connected components with more than one module (Tarjan).
fn cycles(g: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct T<'a> {
        g: &'a BTreeMap<String, BTreeSet<String>>,
        idx: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(t: &mut T<'a>, v: &'a str) {
        let n = t.idx.len();
        t.idx.insert(v, n);
        t.low.insert(v, n);
        t.stack.push(v);
        t.on.insert(v);
        for w in &t.g[v] {
            let w = w.as_str();
            if !t.idx.contains_key(w) {
                visit(t, w);
                let lw = t.low[w];
                let lv = t.low.get_mut(v).unwrap();
                *lv = (*lv).min(lw);
            } else if t.on.contains(w) {
                let iw = t.idx[w];
                let lv = t.low.get_mut(v).unwrap();
                *lv = (*lv).min(iw);
            }
        }
        if t.low[v] == t.idx[v] {
            let mut comp = Vec::new();
            while let Some(w) = t.stack.pop() {
                t.on.remove(w);
                comp.push(w.to_string());
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                t.out.push(comp);
            }
        }
    }
    let mut t = T {
        g,
        idx: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in g.keys() {
        if !t.idx.contains_key(v.as_str()) {
            visit(&mut t, v);
        }
    }
    t.out
}

#[test]
fn no_import_cycles() {
    for krate in ["crates/outboxd/src", "crates/bench/src"] {
        let g = graph(&root().join(krate));
        assert!(g.len() > 5, "{krate}: modules not found");
        let found = cycles(&g);
        let shown: Vec<String> = found
            .iter()
            .map(|c| {
                let edges: Vec<String> = c
                    .iter()
                    .map(|m| {
                        let to: Vec<&String> = g[m].iter().filter(|t| c.contains(t)).collect();
                        format!("{m} → {to:?}")
                    })
                    .collect();
                edges.join("; ")
            })
            .collect();
        assert!(found.is_empty(), "{krate} has import cycles: {shown:#?}");
    }
}

#[test]
fn the_cycle_check_sees_a_cycle() {
    let g: BTreeMap<String, BTreeSet<String>> = [
        ("a", vec!["b"]),
        ("b", vec!["c"]),
        ("c", vec!["a"]),
        ("d", vec!["a"]),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.into_iter().map(String::from).collect()))
    .collect();
    assert_eq!(cycles(&g).len(), 1);
    assert_eq!(
        crate_paths("use crate::{x::y, z};\nlet a = crate::q::r(1);"),
        ["x::y", "z", "q::r"]
    );
}

#[test]
fn relay_files_stay_small() {
    let mut files = Vec::new();
    rust_files(&root().join("crates/outboxd/src/relay"), &mut files);
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        let before_tests = text.split("#[cfg(test)]").next().unwrap_or(&text);
        let n = before_tests.lines().count();
        assert!(
            n <= 500,
            "{} has {n} lines before its tests: split it by job",
            f.display()
        );
    }
}

#[test]
fn the_library_exposes_only_what_other_crates_use() {
    let lib = std::fs::read_to_string(root().join("crates/outboxd/src/lib.rs")).unwrap();
    let public: Vec<&str> = lib
        .lines()
        .filter_map(|l| l.strip_prefix("pub mod "))
        .map(|m| m.trim_end_matches(';'))
        .collect();
    assert_eq!(public, ["cmd", "config", "error", "obs"], "{lib}");
}

#[test]
fn no_process_wide_state_in_the_relay() {
    // Two relays in one process (tests run several) must not share health or counters: state
    // is created by whoever runs a relay (`obs::Observed`) and passed down. Only the crash
    // hooks of the `failpoints` feature read the environment once into a static.
    let mut files = Vec::new();
    rust_files(&root().join("crates/outboxd/src"), &mut files);
    for f in files {
        if f.ends_with("fail.rs") {
            continue;
        }
        let text = code(&std::fs::read_to_string(&f).unwrap());
        for l in text.lines() {
            let t = l.trim_start();
            assert!(
                !(t.starts_with("static ")
                    || t.starts_with("pub static ")
                    || t.contains("OnceLock")),
                "{}: process-wide state: {l}",
                f.display()
            );
        }
    }
}

/// Top-level modules of `crates/outboxd/src` that still import each other (issue 41 untangles
/// them). A pair not listed here fails the test: a new two-way dependency is not added, it is
/// designed away (a shared type one floor down, or a trait or value handed down). A listed pair
/// that no longer imports both ways also fails, so the list only shrinks.
const KNOWN_TWO_WAY: &[(&str, &str)] = &[];

/// Pairs `(a, b)`, `a < b`, of top-level modules whose files import each other.
fn two_way_top_level(g: &BTreeMap<String, BTreeSet<String>>) -> BTreeSet<(String, String)> {
    let top = |m: &str| m.split("::").next().unwrap_or(m).to_string();
    let mut up: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (m, to) in g {
        let from = top(m);
        for t in to {
            let t = top(t);
            if t != from && !from.is_empty() && !t.is_empty() {
                up.entry(from.clone()).or_default().insert(t);
            }
        }
    }
    let mut pairs = BTreeSet::new();
    for (a, to) in &up {
        for b in to {
            if a < b && up.get(b).is_some_and(|back| back.contains(a)) {
                pairs.insert((a.clone(), b.clone()));
            }
        }
    }
    pairs
}

#[test]
fn top_level_modules_gain_no_two_way_imports() {
    let g = graph(&root().join("crates/outboxd/src"));
    let found = two_way_top_level(&g);
    let known: BTreeSet<(String, String)> = KNOWN_TWO_WAY
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    let new: Vec<_> = found.difference(&known).collect();
    assert!(
        new.is_empty(),
        "top-level modules that now import each other: {new:?} (move the shared type down a floor, or hand a trait or value down)"
    );
    let gone: Vec<_> = known.difference(&found).collect();
    assert!(
        gone.is_empty(),
        "no longer two-way, remove from KNOWN_TWO_WAY: {gone:?}"
    );
}

/// Files of `crates/outboxd/src` still over 550 lines before their tests (issue 41 splits them).
const KNOWN_LARGE: &[&str] = &[];

#[test]
fn outboxd_files_stay_within_the_size_rule() {
    let src = root().join("crates/outboxd/src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut large = BTreeSet::new();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        let n = text
            .split("#[cfg(test)]")
            .next()
            .unwrap_or(&text)
            .lines()
            .count();
        if n > 550 {
            large.insert((f.strip_prefix(&src).unwrap().display().to_string(), n));
        }
    }
    let names: BTreeSet<&str> = large.iter().map(|(f, _)| f.as_str()).collect();
    let new: Vec<_> = large
        .iter()
        .filter(|(f, _)| !KNOWN_LARGE.contains(&f.as_str()))
        .collect();
    assert!(
        new.is_empty(),
        "over 550 lines before their tests, split by job: {new:?}"
    );
    let gone: Vec<_> = KNOWN_LARGE.iter().filter(|f| !names.contains(*f)).collect();
    assert!(
        gone.is_empty(),
        "within the size rule now, remove from KNOWN_LARGE: {gone:?}"
    );
}

/// The top-level modules of `crates/outboxd/src` by floor (lib.rs, "Floors"): a module imports
/// its own floor or the floors below (higher numbers), never one above. A top-level module not
/// listed fails the test: place it.
const FLOORS: &[(&str, u8)] = &[
    ("cmd", 1),
    ("supervisor", 2),
    ("relay", 2),
    ("slot", 2),
    ("poison", 2),
    ("replay", 2),
    ("cleanup", 2),
    ("shadow", 2),
    ("obs", 2),
    ("config", 3),
    ("error", 3),
    ("schema", 3),
    ("fail", 3),
    ("model", 4),
];

/// The top-level module graph: `a → b` when a file of `a` names a module of `b`.
fn top_level(g: &BTreeMap<String, BTreeSet<String>>) -> BTreeMap<String, BTreeSet<String>> {
    let top = |m: &str| m.split("::").next().unwrap_or(m).to_string();
    let mut up: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (m, to) in g {
        if m.is_empty() {
            continue;
        }
        let entry = up.entry(top(m)).or_default();
        for t in to.iter().map(|t| top(t)) {
            if t != top(m) && !t.is_empty() {
                entry.insert(t);
            }
        }
    }
    up
}

#[test]
fn top_level_modules_form_no_cycle_and_import_downward() {
    let g = graph(&root().join("crates/outboxd/src"));
    let top = top_level(&g);
    let found = cycles(&top);
    assert!(found.is_empty(), "top-level import cycles: {found:?}");
    let floor: BTreeMap<&str, u8> = FLOORS.iter().copied().collect();
    let mut wrong = Vec::new();
    for (a, to) in &top {
        let Some(&fa) = floor.get(a.as_str()) else {
            wrong.push(format!("{a} is on no floor: add it to FLOORS and lib.rs"));
            continue;
        };
        for b in to {
            let fb = floor.get(b.as_str()).copied().unwrap_or(0);
            if fb < fa {
                wrong.push(format!(
                    "{a} (floor {fa}) imports {b} (floor {fb}), above it"
                ));
            }
        }
    }
    // obs is handed what it shows (obs::view): it imports no other stage.
    for b in top.get("obs").into_iter().flatten() {
        if floor.get(b.as_str()) == Some(&2) {
            wrong.push(format!("obs imports the stage {b}: hand it a view instead"));
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
}

#[test]
fn relative_paths_resolve_to_the_module_they_name() {
    let code = "use super::{a::b, c};\nuse super::super::d::e;\nlet x = self::f::g();";
    assert_eq!(
        relative_paths(code, "p::q::r"),
        ["p::q::a::b", "p::q::c", "p::d::e", "p::q::r::f::g"]
    );
    assert_eq!(relative_paths("use super::x;", "top"), ["x"]);
}
