//! The integrity tag of a parked or held row (issue 40, R47): an HMAC-SHA256 under the relay's
//! key (`[parked] key`, never in the database) over everything a release would publish and
//! everything that decides when it may: slot, event_id, aggregate identity and version, event
//! type, topic, key, value, headers in order, timestamp, and `blocks_aggregate`/`blocked_by`.
//!
//! Why: `outbox_parked` is written by the relay's database role, so whoever holds that
//! credential could add a held event behind an open head (the table's guard only checks the
//! head) or park a record the application never wrote. For tables whose rows are deleted right
//! after insert there is no outbox row to compare with, so the tag is what proves the relay
//! itself wrote the row. A tag cannot be replayed onto another row: (slot, event_id) is unique
//! and both are sealed.
//!
//! Each field is length-prefixed (an absent one has its own marker), so no two different
//! records encode to the same bytes.

use crate::poison::record::ParkedRecord;
use hmac::{Hmac, Mac};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// What the relay checks a stored tag against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TagCheck {
    /// Made by the current key (or the previous one, during a rotation).
    Valid,
    /// The row has no tag (parked before a key was configured, or written through SQL).
    Missing,
    /// A tag that no configured key made for this content: altered or forged.
    Wrong,
}

/// The relay's keys: `current` seals, every key verifies.
#[derive(Clone)]
pub struct Sealer {
    current: Vec<u8>,
    previous: Option<Vec<u8>>,
}

impl std::fmt::Debug for Sealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Sealer([redacted])")
    }
}

/// The stored facts a tag covers besides the record.
pub struct Placement<'a> {
    pub slot: &'a str,
    pub blocks_aggregate: bool,
    pub blocked_by: Option<&'a str>,
}

impl Sealer {
    /// The sealer of `[parked]`, when a key is configured.
    pub fn from_config(c: &crate::config::parked::ParkedConfig) -> Option<Self> {
        Some(Self {
            current: c.key.as_deref()?.trim().as_bytes().to_vec(),
            previous: c
                .previous_key
                .as_deref()
                .map(|k| k.trim().as_bytes().to_vec()),
        })
    }

    fn mac(key: &[u8], at: &Placement<'_>, rec: &ParkedRecord) -> HmacSha256 {
        // Any key length is valid for HMAC; `new_from_slice` cannot fail.
        let mut m = HmacSha256::new_from_slice(key).expect("HMAC takes any key length");
        let mut field = |b: Option<&[u8]>| match b {
            None => m.update(&[0]),
            Some(b) => {
                m.update(&[1]);
                m.update(&(b.len() as u64).to_be_bytes());
                m.update(b);
            }
        };
        field(Some(b"outboxd-parked-v1"));
        field(Some(at.slot.as_bytes()));
        field(Some(rec.event_id.as_bytes()));
        field(rec.aggregate_type.as_deref().map(str::as_bytes));
        field(rec.aggregate_id.as_deref().map(str::as_bytes));
        let version = rec.aggregate_version.map(i64::to_be_bytes);
        field(version.as_ref().map(|v| &v[..]));
        field(rec.event_type.as_deref().map(str::as_bytes));
        field(rec.topic.as_deref().map(str::as_bytes));
        field(rec.key.as_deref());
        field(rec.payload.as_deref());
        let count = (rec.headers.len() as u64).to_be_bytes();
        field(Some(&count));
        for (k, v) in &rec.headers {
            field(Some(k.as_bytes()));
            field(v.as_deref().map(str::as_bytes));
        }
        let ts = rec.timestamp_ms.map(i64::to_be_bytes);
        field(ts.as_ref().map(|v| &v[..]));
        field(Some(&[u8::from(at.blocks_aggregate)]));
        field(at.blocked_by.map(str::as_bytes));
        m
    }

    /// The tag stored with a row the relay parks or holds.
    pub fn seal(&self, at: &Placement<'_>, rec: &ParkedRecord) -> Vec<u8> {
        Self::mac(&self.current, at, rec)
            .finalize()
            .into_bytes()
            .to_vec()
    }

    /// Checks a stored tag in constant time against every configured key.
    pub fn check(&self, at: &Placement<'_>, rec: &ParkedRecord, tag: Option<&[u8]>) -> TagCheck {
        let Some(tag) = tag else {
            return TagCheck::Missing;
        };
        let keys = std::iter::once(&self.current).chain(self.previous.as_ref());
        for key in keys {
            if Self::mac(key, at, rec).verify_slice(tag).is_ok() {
                return TagCheck::Valid;
            }
        }
        TagCheck::Wrong
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sealer(key: &str, previous: Option<&str>) -> Sealer {
        Sealer {
            current: key.as_bytes().to_vec(),
            previous: previous.map(|k| k.as_bytes().to_vec()),
        }
    }

    fn rec() -> ParkedRecord {
        ParkedRecord {
            event_id: "e1".into(),
            aggregate_type: Some("acct".into()),
            aggregate_id: Some("A".into()),
            aggregate_version: Some(2),
            event_type: Some("Deposited".into()),
            topic: Some("t".into()),
            key: Some(b"A".to_vec()),
            payload: Some(br#"{"n": 1}"#.to_vec()),
            headers: vec![("h".into(), Some("1".into())), ("null".into(), None)],
            timestamp_ms: Some(5),
        }
    }

    const AT: Placement<'static> = Placement {
        slot: "s",
        blocks_aggregate: true,
        blocked_by: Some("e0"),
    };

    #[test]
    fn every_sealed_field_changes_the_tag() {
        let s = sealer("k", None);
        let tag = s.seal(&AT, &rec());
        assert_eq!(s.check(&AT, &rec(), Some(&tag)), TagCheck::Valid);
        assert_eq!(s.check(&AT, &rec(), None), TagCheck::Missing);
        type Edit = Box<dyn Fn(&mut ParkedRecord)>;
        let edits: Vec<Edit> = vec![
            Box::new(|r| r.event_id = "e2".into()),
            Box::new(|r| r.aggregate_id = Some("B".into())),
            Box::new(|r| r.aggregate_version = Some(3)),
            Box::new(|r| r.aggregate_version = None),
            Box::new(|r| r.event_type = Some("Withdrawn".into())),
            Box::new(|r| r.topic = Some("u".into())),
            Box::new(|r| r.key = None),
            Box::new(|r| r.payload = Some(br#"{"n": 1000}"#.to_vec())),
            Box::new(|r| r.headers[1].1 = Some(String::new())),
            Box::new(|r| r.headers.reverse()),
            Box::new(|r| r.timestamp_ms = Some(6)),
        ];
        for edit in edits {
            let mut r = rec();
            edit(&mut r);
            assert_eq!(s.check(&AT, &r, Some(&tag)), TagCheck::Wrong, "{r:?}");
        }
        for at in [
            Placement { slot: "t", ..AT },
            Placement {
                blocks_aggregate: false,
                ..AT
            },
            Placement {
                blocked_by: None,
                ..AT
            },
        ] {
            assert_eq!(s.check(&at, &rec(), Some(&tag)), TagCheck::Wrong);
        }
        // Field boundaries are part of the encoding: moving bytes between fields is seen.
        let mut r = rec();
        r.aggregate_type = Some("acctA".into());
        r.aggregate_id = Some(String::new());
        assert_eq!(s.check(&AT, &r, Some(&tag)), TagCheck::Wrong);
    }

    #[test]
    fn another_key_is_refused_and_the_previous_one_verifies_during_a_rotation() {
        let old = sealer("old", None).seal(&AT, &rec());
        assert_eq!(
            sealer("new", None).check(&AT, &rec(), Some(&old)),
            TagCheck::Wrong
        );
        let rotated = sealer("new", Some("old"));
        assert_eq!(rotated.check(&AT, &rec(), Some(&old)), TagCheck::Valid);
        let new = rotated.seal(&AT, &rec());
        assert_ne!(new, old, "new rows are sealed by the new key");
        assert_eq!(
            sealer("new", None).check(&AT, &rec(), Some(&new)),
            TagCheck::Valid
        );
    }
}
