//! Decoder for the pgoutput messages pgwire-replication hands over raw (protocol version 1,
//! text format): Relation and Insert are decoded; Update, Delete, Truncate, Type and Origin are
//! recognised so the caller can count and ignore them.
//!
//! Decoding borrows from the message bytes: an Insert yields column slices into the buffer the
//! replication client already owns, so the hot path allocates nothing per row.

use crate::model::stream::DecodeError;

/// One column of a Relation message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Column {
    pub name: String,
    pub type_oid: u32,
    /// `atttypmod`: e.g. the precision of `timestamptz(3)`; -1 when the type has none.
    pub type_modifier: i32,
}

/// A Relation message: the schema of a table as of this point of the stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Relation {
    pub id: u32,
    pub namespace: String,
    pub name: String,
    pub columns: Vec<Column>,
}

/// A column value of a tuple, borrowed from the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Value<'a> {
    Null,
    /// Unchanged TOASTed value; never appears in an Insert.
    Unchanged,
    Text(&'a [u8]),
}

/// What a raw XLogData payload is.
#[derive(Debug, PartialEq, Eq)]
pub enum Message<'a> {
    Relation(Relation),
    /// Insert into relation `rel`; the tuple is decoded with [`decode_tuple`] into a reused buffer.
    Insert {
        rel: u32,
        tuple: &'a [u8],
    },
    Update,
    Delete,
    Truncate,
    /// Type, Origin, and anything a newer server adds: ignored.
    Other(u8),
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], DecodeError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or(DecodeError::Truncated(what))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u8(&mut self, what: &'static str) -> Result<u8, DecodeError> {
        Ok(self.take(1, what)?[0])
    }
    fn u16(&mut self, what: &'static str) -> Result<u16, DecodeError> {
        let b = self.take(2, what)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }
    fn u32(&mut self, what: &'static str) -> Result<u32, DecodeError> {
        let b = self.take(4, what)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn cstr(&mut self, what: &'static str) -> Result<String, DecodeError> {
        let rest = &self.buf[self.pos..];
        let nul = rest
            .iter()
            .position(|&b| b == 0)
            .ok_or(DecodeError::Truncated(what))?;
        let s = std::str::from_utf8(&rest[..nul]).map_err(|_| DecodeError::BadName)?;
        self.pos += nul + 1;
        Ok(s.to_string())
    }
    fn rest(&self) -> &'a [u8] {
        &self.buf[self.pos..]
    }
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
}

/// The fewest bytes one column of a Relation takes: flags, an empty name's NUL, type, typmod.
const MIN_RELATION_COLUMN: usize = 1 + 1 + 4 + 4;

/// Classifies and (for Relation/Insert) decodes one XLogData payload.
pub fn decode(buf: &[u8]) -> Result<Message<'_>, DecodeError> {
    let mut r = Reader::new(buf);
    let tag = *buf.first().ok_or(DecodeError::Empty)?;
    r.pos = 1;
    Ok(match tag {
        b'R' => Message::Relation(decode_relation(&mut r)?),
        b'I' => {
            let rel = r.u32("insert relation id")?;
            let marker = r.u8("insert tuple marker")?;
            if marker != b'N' {
                return Err(DecodeError::BadTupleMarker(marker as char, "Insert"));
            }
            Message::Insert {
                rel,
                tuple: r.rest(),
            }
        }
        b'U' => Message::Update,
        b'D' => Message::Delete,
        b'T' => Message::Truncate,
        other => Message::Other(other),
    })
}

fn decode_relation(r: &mut Reader<'_>) -> Result<Relation, DecodeError> {
    let id = r.u32("relation id")?;
    let namespace = r.cstr("relation namespace")?;
    let name = r.cstr("relation name")?;
    let _replica_identity = r.u8("replica identity")?;
    let ncols = r.u16("relation column count")?;
    // The count is the server's word: reserve no more than the bytes left can hold, so a
    // message of ten bytes claiming 65535 columns cannot make us allocate for them.
    let mut columns = Vec::with_capacity((ncols as usize).min(r.remaining() / MIN_RELATION_COLUMN));
    for _ in 0..ncols {
        let _flags = r.u8("column flags")?;
        let name = r.cstr("column name")?;
        let type_oid = r.u32("column type")?;
        let type_modifier = r.u32("column typmod")? as i32;
        columns.push(Column {
            name,
            type_oid,
            type_modifier,
        });
    }
    Ok(Relation {
        id,
        namespace,
        name,
        columns,
    })
}

/// Decodes TupleData into `out` (cleared first), borrowing values from `tuple`.
pub fn decode_tuple<'a>(tuple: &'a [u8], out: &mut Vec<Value<'a>>) -> Result<(), DecodeError> {
    out.clear();
    let mut r = Reader::new(tuple);
    let n = r.u16("tuple column count")?;
    for _ in 0..n {
        let v = match r.u8("column kind")? {
            b'n' => Value::Null,
            b'u' => Value::Unchanged,
            b't' => {
                let len = r.u32("column length")? as usize;
                Value::Text(r.take(len, "column value")?)
            }
            b'b' => return Err(DecodeError::BinaryColumn),
            k => return Err(DecodeError::BadColumnKind(k as char)),
        };
        out.push(v);
    }
    Ok(())
}

/// Encoders used by tests and benchmarks to build pgoutput messages byte-exactly.
pub mod encode {
    use super::Relation;

    pub fn relation(rel: &Relation) -> Vec<u8> {
        let mut b = vec![b'R'];
        b.extend_from_slice(&rel.id.to_be_bytes());
        for s in [&rel.namespace, &rel.name] {
            b.extend_from_slice(s.as_bytes());
            b.push(0);
        }
        b.push(b'd');
        b.extend_from_slice(&(rel.columns.len() as u16).to_be_bytes());
        for c in &rel.columns {
            b.push(0);
            b.extend_from_slice(c.name.as_bytes());
            b.push(0);
            b.extend_from_slice(&c.type_oid.to_be_bytes());
            b.extend_from_slice(&c.type_modifier.to_be_bytes());
        }
        b
    }

    pub fn insert(rel: u32, values: &[Option<&[u8]>]) -> Vec<u8> {
        let mut b = vec![b'I'];
        b.extend_from_slice(&rel.to_be_bytes());
        b.push(b'N');
        b.extend_from_slice(&(values.len() as u16).to_be_bytes());
        for v in values {
            match v {
                None => b.push(b'n'),
                Some(t) => {
                    b.push(b't');
                    b.extend_from_slice(&(t.len() as u32).to_be_bytes());
                    b.extend_from_slice(t);
                }
            }
        }
        b
    }
}

#[cfg(test)]
mod fuzz;

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn rel() -> Relation {
        Relation {
            id: 16384,
            namespace: "public".into(),
            name: "outbox".into(),
            columns: vec![
                Column {
                    name: "event_id".into(),
                    type_oid: 2950,
                    type_modifier: -1,
                },
                Column {
                    name: "payload".into(),
                    type_oid: 3802,
                    type_modifier: 7,
                },
            ],
        }
    }

    #[test]
    fn relation_roundtrip() {
        let r = rel();
        assert_eq!(decode(&encode::relation(&r)).unwrap(), Message::Relation(r));
    }

    #[test]
    fn insert_with_null_and_text() {
        let bytes = encode::insert(7, &[Some(b"abc"), None, Some(b"")]);
        let Message::Insert { rel, tuple } = decode(&bytes).unwrap() else {
            panic!("not an insert")
        };
        assert_eq!(rel, 7);
        let mut vals = Vec::new();
        decode_tuple(tuple, &mut vals).unwrap();
        assert_eq!(
            vals,
            vec![Value::Text(b"abc"), Value::Null, Value::Text(b"")]
        );
    }

    #[test]
    fn other_messages_are_classified() {
        assert_eq!(decode(b"U\0\0\0\x01").unwrap(), Message::Update);
        assert_eq!(decode(b"D").unwrap(), Message::Delete);
        assert_eq!(decode(b"T").unwrap(), Message::Truncate);
        assert_eq!(decode(b"Y").unwrap(), Message::Other(b'Y'));
        assert_eq!(decode(b"").unwrap_err(), DecodeError::Empty);
    }

    #[test]
    fn errors_are_precise() {
        assert_eq!(
            decode(b"I\0\0\0\x01K").unwrap_err(),
            DecodeError::BadTupleMarker('K', "Insert")
        );
        let mut v = Vec::new();
        assert_eq!(
            decode_tuple(b"\0\x01b", &mut v).unwrap_err(),
            DecodeError::BinaryColumn
        );
        assert_eq!(
            decode_tuple(b"\0\x01t\0\0\0\x09abc", &mut v).unwrap_err(),
            DecodeError::Truncated("column value")
        );
    }

    proptest! {
        #[test]
        fn insert_roundtrips(values in proptest::collection::vec(
            proptest::option::of(proptest::collection::vec(any::<u8>(), 0..64)), 0..20)) {
            let refs: Vec<Option<&[u8]>> = values.iter().map(|v| v.as_deref()).collect();
            let bytes = encode::insert(1, &refs);
            let Message::Insert { tuple, .. } = decode(&bytes).unwrap() else { panic!() };
            let mut out = Vec::new();
            decode_tuple(tuple, &mut out).unwrap();
            let back: Vec<Option<&[u8]>> = out.iter().map(|v| match v {
                Value::Text(t) => Some(*t),
                _ => None,
            }).collect();
            prop_assert_eq!(back, refs);
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            if let Ok(Message::Insert { tuple, .. }) = decode(&bytes) {
                let mut out = Vec::new();
                let _ = decode_tuple(tuple, &mut out);
            }
        }
    }
}
