//! Fuzz harness of the decoder (issue 15): whatever a broken or hostile server sends, `decode`
//! and `decode_tuple` answer `Ok` or `Err` — never a panic, a hang, or an allocation the bytes
//! do not pay for.
//!
//! Inputs are arbitrary bytes and mutations (flips, truncations, extensions, hostile counts and
//! lengths written over a field) of valid messages: those the encoders build and the seeds of
//! `crates/outboxd/fuzz-corpus/pgoutput/`, which every run also replays as they are. Proptest's
//! default of 256 cases per property suits CI; `PROPTEST_CASES=100000` runs long
//! (docs/development.md, "Fuzzing").

use super::encode;
use super::{decode, decode_tuple, Column, DecodeError, Message, Relation, Value};
use proptest::prelude::*;
use std::path::PathBuf;

/// Seed messages, in the corpus: `ok-*` decode (tuple included), `err-*` are refused, anything
/// else only must not panic.
fn corpus_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fuzz-corpus/pgoutput")
}

fn outbox_relation(ncols: usize) -> Relation {
    let names = [
        "event_id",
        "aggregate_type",
        "aggregate_id",
        "aggregate_version",
        "event_type",
        "schema_version",
        "payload",
        "headers",
        "created_at",
    ];
    Relation {
        id: 16384,
        namespace: "public".into(),
        name: "outbox".into(),
        columns: names
            .iter()
            .cycle()
            .take(ncols)
            .map(|n| Column {
                name: n.to_string(),
                type_oid: 25,
                type_modifier: -1,
            })
            .collect(),
    }
}

/// Valid messages as the server sends them, named for the corpus.
fn valid_messages() -> Vec<(&'static str, Vec<u8>)> {
    let row: [Option<&[u8]>; 9] = [
        Some(b"0190f1c2-7d3a-7b4e-9a1b-2c3d4e5f6a7b"),
        Some(b"order"),
        Some(b"o-1"),
        Some(b"3"),
        Some(b"OrderPlaced"),
        None,
        Some(b"{\"total\": 42}"),
        Some(b"{\"traceparent\": \"00-ab-cd-01\"}"),
        Some(b"2026-12-02 12:00:00.123456+00"),
    ];
    let mut begin = vec![b'B'];
    begin.extend_from_slice(&0x16_B374_D848u64.to_be_bytes());
    begin.extend_from_slice(&800_000_000_000_000i64.to_be_bytes());
    begin.extend_from_slice(&742u32.to_be_bytes());
    let mut commit = vec![b'C', 0];
    commit.extend_from_slice(&0x16_B374_D848u64.to_be_bytes());
    commit.extend_from_slice(&0x16_B374_D878u64.to_be_bytes());
    commit.extend_from_slice(&800_000_000_000_000i64.to_be_bytes());
    vec![
        ("ok-relation-outbox", encode::relation(&outbox_relation(9))),
        ("ok-relation-empty", encode::relation(&outbox_relation(0))),
        ("ok-insert-outbox-row", encode::insert(16384, &row)),
        ("ok-insert-nulls", encode::insert(16384, &[None; 9])),
        ("ok-insert-empty", encode::insert(16384, &[])),
        ("ok-begin", begin),
        ("ok-commit", commit),
        ("ok-update", b"U\0\0\x40\0N\0\0".to_vec()),
        ("ok-origin", b"O\0\0\0\0\0\0\0\x01origin\0".to_vec()),
    ]
}

/// Hostile messages: counts and lengths that claim far more than the bytes hold.
fn hostile_messages() -> Vec<(&'static str, Vec<u8>)> {
    let mut rel_huge_count = b"R\0\0\x40\0public\0outbox\0d".to_vec();
    rel_huge_count.extend_from_slice(&u16::MAX.to_be_bytes());
    let mut insert_huge_count = b"I\0\0\x40\0N".to_vec();
    insert_huge_count.extend_from_slice(&u16::MAX.to_be_bytes());
    let mut insert_huge_len = b"I\0\0\x40\0N\0\x01t".to_vec();
    insert_huge_len.extend_from_slice(&(1u32 << 31).to_be_bytes());
    insert_huge_len.extend_from_slice(b"abc");
    let mut insert_max_len = b"I\0\0\x40\0N\0\x01t".to_vec();
    insert_max_len.extend_from_slice(&u32::MAX.to_be_bytes());
    vec![
        ("err-empty", vec![]),
        ("err-relation-huge-column-count", rel_huge_count),
        (
            "err-relation-unterminated-name",
            b"R\0\0\x40\0public".to_vec(),
        ),
        (
            "err-relation-not-utf8",
            b"R\0\0\x40\0\xff\xfe\0outbox\0d\0\0".to_vec(),
        ),
        ("err-insert-huge-column-count", insert_huge_count),
        ("err-insert-huge-length", insert_huge_len),
        ("err-insert-max-length", insert_max_len),
        (
            "err-insert-binary-column",
            b"I\0\0\x40\0N\0\x01b\0\0\0\x01x".to_vec(),
        ),
        ("err-insert-bad-kind", b"I\0\0\x40\0N\0\x01z".to_vec()),
        ("err-insert-bad-marker", b"I\0\0\x40\0K\0\0".to_vec()),
        ("err-insert-truncated-id", b"I\0\0".to_vec()),
    ]
}

/// Decodes a message the way the stages do: Ok only if the tuple decodes as well.
fn decode_fully(bytes: &[u8]) -> Result<(), DecodeError> {
    if let Message::Insert { tuple, .. } = decode(bytes)? {
        let mut out = Vec::new();
        decode_tuple(tuple, &mut out)?;
        // Every value was paid for by at least one byte of the tuple.
        assert!(out.len() <= tuple.len());
    }
    Ok(())
}

#[test]
fn corpus_replays() {
    let mut n = 0;
    for entry in std::fs::read_dir(corpus_dir()).expect("fuzz-corpus/pgoutput exists") {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let bytes = std::fs::read(&path).unwrap();
        let r = decode_fully(&bytes);
        if name.starts_with("ok-") {
            assert!(r.is_ok(), "{name}: {r:?}");
        } else if name.starts_with("err-") {
            assert!(r.is_err(), "{name} decoded");
        }
        n += 1;
    }
    assert!(n >= valid_messages().len() + hostile_messages().len());
}

/// The seeds in the corpus are the encoders' output: `OUTBOXD_WRITE_CORPUS=1` rewrites them
/// after a format change (other files in the directory are kept).
#[test]
fn corpus_holds_the_seeds() {
    let dir = corpus_dir();
    let write = std::env::var_os("OUTBOXD_WRITE_CORPUS").is_some();
    for (name, bytes) in valid_messages().into_iter().chain(hostile_messages()) {
        let path = dir.join(format!("{name}.bin"));
        if write {
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(&path, &bytes).unwrap();
        }
        assert_eq!(std::fs::read(&path).ok(), Some(bytes), "{name}: stale seed");
    }
}

#[test]
fn hostile_counts_and_lengths_are_refused_cheaply() {
    let hostile: std::collections::HashMap<_, _> = hostile_messages().into_iter().collect();
    assert_eq!(
        decode(&hostile["err-relation-huge-column-count"]).unwrap_err(),
        DecodeError::Truncated("column flags")
    );
    for (name, what) in [
        ("err-insert-huge-column-count", "column kind"),
        ("err-insert-huge-length", "column value"),
        ("err-insert-max-length", "column value"),
    ] {
        let Message::Insert { tuple, .. } = decode(&hostile[name]).unwrap() else {
            panic!("{name}")
        };
        let mut out = Vec::new();
        assert_eq!(
            decode_tuple(tuple, &mut out).unwrap_err(),
            DecodeError::Truncated(what),
            "{name}"
        );
    }
}

/// One edit of a valid message. Positions are taken modulo the message's length.
#[derive(Debug, Clone)]
enum Edit {
    Flip(usize, u8),
    Set(usize, u8),
    Truncate(usize),
    Extend(Vec<u8>),
    Remove(usize, usize),
    /// A hostile count or length written over the bytes at a position.
    Count16(usize, u16),
    Len32(usize, u32),
}

fn edit() -> impl Strategy<Value = Edit> {
    let big16 = prop_oneof![
        Just(0u16),
        Just(1),
        Just(u16::MAX),
        Just(0x8000),
        any::<u16>()
    ];
    let big32 = prop_oneof![
        Just(0u32),
        Just(u32::MAX),
        Just(1 << 31),
        Just((1 << 31) - 1),
        any::<u32>()
    ];
    prop_oneof![
        (any::<usize>(), 1u8..).prop_map(|(i, x)| Edit::Flip(i, x)),
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Edit::Set(i, b)),
        any::<usize>().prop_map(Edit::Truncate),
        proptest::collection::vec(any::<u8>(), 1..16).prop_map(Edit::Extend),
        (any::<usize>(), 1usize..8).prop_map(|(i, n)| Edit::Remove(i, n)),
        (any::<usize>(), big16).prop_map(|(i, v)| Edit::Count16(i, v)),
        (any::<usize>(), big32).prop_map(|(i, v)| Edit::Len32(i, v)),
    ]
}

fn apply(mut b: Vec<u8>, edits: &[Edit]) -> Vec<u8> {
    let overwrite = |b: &mut Vec<u8>, i: usize, v: &[u8]| {
        if !b.is_empty() {
            let at = i % b.len();
            let end = (at + v.len()).min(b.len());
            b[at..end].copy_from_slice(&v[..end - at]);
        }
    };
    for e in edits {
        match e {
            Edit::Flip(i, x) if !b.is_empty() => {
                let n = b.len();
                b[i % n] ^= x;
            }
            Edit::Set(i, v) if !b.is_empty() => {
                let n = b.len();
                b[i % n] = *v;
            }
            Edit::Truncate(i) => b.truncate(i % (b.len() + 1)),
            Edit::Extend(x) => b.extend_from_slice(x),
            Edit::Remove(i, n) if !b.is_empty() => {
                let at = i % b.len();
                let end = (at + n).min(b.len());
                b.drain(at..end);
            }
            Edit::Count16(i, v) => overwrite(&mut b, *i, &v.to_be_bytes()),
            Edit::Len32(i, v) => overwrite(&mut b, *i, &v.to_be_bytes()),
            _ => {}
        }
    }
    b
}

/// The messages mutations start from: the encoders' and every file of the corpus.
fn seeds() -> Vec<Vec<u8>> {
    let mut s: Vec<Vec<u8>> = valid_messages().into_iter().map(|(_, b)| b).collect();
    if let Ok(dir) = std::fs::read_dir(corpus_dir()) {
        s.extend(dir.flatten().filter_map(|e| std::fs::read(e.path()).ok()));
    }
    s
}

fn any_tuple_value() -> impl Strategy<Value = Option<Vec<u8>>> {
    proptest::option::of(proptest::collection::vec(any::<u8>(), 0..48))
}

proptest! {
    #[test]
    fn arbitrary_bytes_are_ok_or_err(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = decode_fully(&bytes);
        // The same bytes as a message of each kind the decoder reads.
        for tag in [b'R', b'I'] {
            let mut b = vec![tag];
            b.extend_from_slice(&bytes);
            let _ = decode_fully(&b);
        }
        let mut out = Vec::new();
        let _ = decode_tuple(&bytes, &mut out);
    }

    #[test]
    fn mutated_messages_are_ok_or_err(
        seed in proptest::sample::select(seeds()),
        edits in proptest::collection::vec(edit(), 1..6),
    ) {
        let bytes = apply(seed, &edits);
        if let Ok(Message::Relation(rel)) = decode(&bytes) {
            // Whatever decodes was in the bytes: each column took at least its minimum size.
            prop_assert!(rel.columns.len() * super::MIN_RELATION_COLUMN <= bytes.len());
        }
        let _ = decode_fully(&bytes);
    }

    /// Mutated tuples of generated rows (NULLs, empty and binary values, many columns).
    #[test]
    fn mutated_tuples_are_ok_or_err(
        values in proptest::collection::vec(any_tuple_value(), 0..40),
        edits in proptest::collection::vec(edit(), 0..4),
    ) {
        let refs: Vec<Option<&[u8]>> = values.iter().map(|v| v.as_deref()).collect();
        let bytes = apply(encode::insert(7, &refs), &edits);
        let r = decode_fully(&bytes);
        if edits.is_empty() {
            prop_assert!(r.is_ok(), "{:?}", r);
        }
        let mut out = vec![Value::Null; 3];
        let _ = decode_tuple(&bytes, &mut out);
    }
}
