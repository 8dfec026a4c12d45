//! Optional JSON Schema validation before produce: `schemas/<event_type>/<schema_version>.json`.
//! A payload that fails its schema is a deterministic failure (parked or halting, per policy).
//! Event types without a schema file pass unvalidated.

use std::collections::HashMap;
use std::path::PathBuf;

pub struct Validator {
    dir: PathBuf,
    /// No schema file for an event's type and version is a failure, not a pass.
    require: bool,
    /// Compiled schemas by (event_type, schema_version); `None` = no schema file.
    cache: HashMap<(String, String), Option<jsonschema::Validator>>,
}

impl Validator {
    /// The validator `[validation]` asks for (None: no schema_dir, nothing is validated).
    pub fn from_config(cfg: &crate::config::ValidationConfig) -> Option<Self> {
        let mut v = Self::new(cfg.schema_dir.as_ref()?);
        v.require = cfg.require_schema;
        Some(v)
    }

    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            require: false,
            dir: dir.into(),
            cache: HashMap::new(),
        }
    }

    /// Validates a payload; `Err` carries a message naming the schema file and the failures.
    pub fn check(
        &mut self,
        event_type: &str,
        schema_version: &str,
        payload: &[u8],
    ) -> Result<(), String> {
        let key = (event_type.to_string(), schema_version.to_string());
        if !self.cache.contains_key(&key) {
            // Keys come from the stream: a flood of new event types must not grow it forever.
            if self.cache.len() >= 1024 {
                self.cache.clear();
            }
            let compiled = self.load(event_type, schema_version)?;
            self.cache.insert(key.clone(), compiled);
        }
        let Some(v) = self.cache.get(&key).and_then(Option::as_ref) else {
            if self.require {
                return Err(format!(
                    "no schema {}/{}/{}.json and validation.require_schema = true",
                    self.dir.display(),
                    event_type,
                    schema_version
                ));
            }
            return Ok(());
        };
        let value: serde_json::Value =
            serde_json::from_slice(payload).map_err(|e| format!("payload is not JSON: {e}"))?;
        let errors: Vec<String> = v
            .iter_errors(&value)
            .take(5)
            // Field and rule only: the error's own text quotes the offending value, and this
            // message goes to logs, outbox_parked and `outboxd status`.
            .map(|e| {
                let at = e.instance_path().to_string();
                let at = if at.is_empty() { "/".to_string() } else { at };
                format!("{at} violates {}", e.schema_path())
            })
            .collect();
        if errors.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "payload fails schema {}/{}/{}.json: {}",
                self.dir.display(),
                event_type,
                schema_version,
                errors.join("; ")
            ))
        }
    }

    fn load(
        &self,
        event_type: &str,
        version: &str,
    ) -> Result<Option<jsonschema::Validator>, String> {
        // Names come from the WAL: never let them walk out of the schema directory.
        let safe = |s: &str| !s.is_empty() && !s.contains(['/', '\\']) && s != "." && s != "..";
        if !safe(event_type) || !safe(version) {
            return Ok(None);
        }
        let path = self.dir.join(event_type).join(format!("{version}.json"));
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
        };
        let schema: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| format!("{} is not JSON: {e}", path.display()))?;
        jsonschema::validator_for(&schema)
            .map(Some)
            .map_err(|e| format!("{} is not a valid JSON Schema: {e}", path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validates_against_the_versioned_schema() {
        let dir = std::env::temp_dir().join(format!("outboxd-schemas-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("OrderPlaced")).unwrap();
        std::fs::write(
            dir.join("OrderPlaced/1.json"),
            r#"{"type": "object", "required": ["order_id"], "properties": {"order_id": {"type": "string"}}}"#,
        )
        .unwrap();
        let mut v = Validator::new(&dir);
        assert!(v
            .check("OrderPlaced", "1", br#"{"order_id": "o-1"}"#)
            .is_ok());
        let err = v
            .check("OrderPlaced", "1", br#"{"order_id": 5}"#)
            .unwrap_err();
        assert!(
            err.contains("OrderPlaced/1.json")
                && err.contains("/order_id violates /properties/order_id/type"),
            "{err}"
        );
        // Never the value itself: payloads may carry personal data.
        let err = v
            .check("OrderPlaced", "1", br#"{"order_id": 424242}"#)
            .unwrap_err();
        assert!(!err.contains("424242"), "{err}");
        assert!(
            v.check("OrderPlaced", "2", br#"{}"#).is_ok(),
            "no schema for v2"
        );
        assert!(v.check("../etc", "1", br#"{}"#).is_ok());
        v.require = true;
        let err = v.check("OrderPlaced", "2", br#"{}"#).unwrap_err();
        assert!(err.contains("require_schema"), "{err}");
        assert!(
            v.check("../etc", "1", br#"{}"#).is_err(),
            "a hostile name has no schema"
        );
        let _ = std::fs::remove_dir_all(dir);
    }
}
