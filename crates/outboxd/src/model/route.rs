//! The router's vocabulary that config, errors and the stages share: a setting that cannot work
//! ([`SettingError`]), a row that cannot be routed ([`RouteError`]), the header names outboxd
//! derives itself. The router itself: `crate::relay::route`.

use thiserror::Error;

/// The column types a header may come from, for messages (the renderings: `relay/route/additional`).
pub const SUPPORTED: &str =
    "text, varchar, char, smallint, integer, bigint, boolean, uuid, json, jsonb, timestamptz";

/// A routing setting that cannot work (the topic template, the column names); the message names
/// the setting and the fix.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
#[error("{0}")]
pub struct SettingError(pub String);

#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum RouteError {
    #[error("outbox table {table} has no column `{column}` (configured as source.columns.{key}); restore the column or fix the config — nothing past this point is confirmed")]
    MissingColumn {
        table: String,
        column: String,
        key: &'static str,
    },
    #[error("event at column `{0}` is NULL or missing; the outbox row cannot be routed")]
    NullField(&'static str),
    #[error("column `{0}` is not valid UTF-8")]
    NotUtf8(&'static str),
    #[error("headers column is not a JSON object of strings: {0}")]
    BadHeaders(String),
    /// Consumers deduplicate by `event_id` and the inbox parses it as a UUID.
    #[error("event_id is not a UUID; consumers deduplicate by it (the inbox refuses the record)")]
    EventIdNotUuid,
    /// A text payload column carries something that is not JSON (json/jsonb columns cannot).
    #[error("payload is not JSON: {0}")]
    PayloadNotJson(String),
    /// A bytea payload's text from the server is not bytea output (a broken server or proxy).
    #[error(
        "payload column is bytea but its value is {0}; the record would not carry the row's bytes"
    )]
    BadBytea(String),
    /// JSON Schema validation reads the payload as JSON: a bytea payload (Avro, Protobuf…)
    /// would fail every check, so the combination is refused when the table's schema arrives.
    #[error("payload column `{column}` of {table} is bytea but [validation] schema_dir applies to it; JSON Schema validates JSON payloads only: set schema_dir only on the json tables' [source.tables.validation], not in [validation], or use a json/jsonb column")]
    SchemaOnBinary { table: String, column: String },
    /// A row may not set a header the relay derives from its columns: consumers deduplicate
    /// and order by them, so a spoofed `event_id` or `aggregate_version` would defeat both.
    #[error("headers column sets `{0}`, which outboxd derives from the row's columns ({RESERVED}, and the headers of source.columns.additional); a row may not override them: rename the header")]
    ReservedHeader(String),
    /// A column of `[source.columns] additional` whose type Debezium renders as something
    /// outboxd does not reproduce: refused when the schema arrives, not sent differently.
    #[error("column `{column}` of {table} is {type_name}; source.columns.additional places only {} in headers (as Debezium writes them): remove the entry or change the column's type", SUPPORTED)]
    UnsupportedHeaderColumn {
        table: String,
        column: String,
        type_name: String,
    },
    /// The text of a placed column is not what Postgres writes for its type (never quoted:
    /// the value may be personal data).
    #[error("column `{column}` (header `{header}`) holds text that is not Postgres's output for its type; the header cannot be written as Debezium writes it")]
    BadHeaderValue { column: String, header: String },
    /// `[sink] format = "cloudevents"`: the row cannot be a CloudEvent (issue 42).
    #[error("the event cannot be written as a CloudEvent: {0}")]
    CloudEvent(String),
    /// `[sink] format = "cloudevents"`: a row header would shadow a CloudEvents attribute that
    /// outboxd sets itself (`ce_<attribute>`, the attribute's own name, or `content-type`).
    #[error("headers column sets `{header}`, which would set the CloudEvents attribute `{attribute}`; outboxd sets `{attribute}` itself (the attributes it sets: specversion, id, source, type, subject, time, datacontenttype, dataschema, partitionkey, aggregatetype, aggregateversion, schemaversion, traceparent and tracestate from the row's `traceparent`/`tracestate` headers; data and data_base64 are the envelope's): rename the header")]
    CloudEventAttribute {
        header: String,
        attribute: &'static str,
    },
    /// `[sink] format = "cloudevents"`: a `ce_` row header, which the Kafka binding reads as an
    /// extension attribute, whose name is no CloudEvents attribute name.
    #[error("headers column sets `{0}`: a `ce_` header is a CloudEvents extension attribute (Kafka protocol binding), but its name is not one CloudEvents 1.0 allows (the header must be `ce_` followed by lower-case ASCII letters a-z and digits 0-9 only); rename it, or drop the `ce_` prefix to send a plain Kafka header")]
    CloudEventExtensionName(String),
}

/// The header names outboxd sets itself, from the row's columns: the wire contract, the same
/// list as `outboxd_outbox::RESERVED_HEADERS` (writer side) and the inbox's protocol headers.
pub const RESERVED_HEADERS: [&str; 6] = [
    "event_id",
    "event_type",
    "aggregate_type",
    "aggregate_id",
    "aggregate_version",
    "schema_version",
];
const RESERVED: &str =
    "event_id, event_type, aggregate_type, aggregate_id, aggregate_version, schema_version";

/// Is `name` one of [`RESERVED_HEADERS`], in any letter case (some consumer frameworks look
/// header names up case-insensitively)?
pub fn is_reserved_header(name: &str) -> bool {
    RESERVED_HEADERS
        .iter()
        .any(|r| r.eq_ignore_ascii_case(name))
}

impl RouteError {
    /// The poison class of a row that cannot be routed (`outbox_parked.error_class`, metrics).
    pub fn class(&self) -> &'static str {
        match self {
            Self::ReservedHeader(_) | Self::CloudEventAttribute { .. } => "reserved_header",
            Self::CloudEvent(_) | Self::CloudEventExtensionName(_) => "invalid_event",
            Self::MissingColumn { .. }
            | Self::NullField(_)
            | Self::NotUtf8(_)
            | Self::BadHeaders(_)
            | Self::EventIdNotUuid
            | Self::PayloadNotJson(_)
            | Self::BadBytea(_)
            | Self::SchemaOnBinary { .. }
            | Self::UnsupportedHeaderColumn { .. }
            | Self::BadHeaderValue { .. } => "invalid_event",
        }
    }
}

/// The header a table's `content_type` is sent in.
pub const CONTENT_TYPE_HEADER: &str = "content-type";
