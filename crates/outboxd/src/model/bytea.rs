//! A `bytea` column's value as pgoutput (and `::text` over SQL) writes it, back to its bytes.
//!
//! pgoutput sends every column as its type's text output; for `bytea` that is `\x` and two hex
//! digits per byte (`bytea_output = hex`, the default), or the older escape format (`escape`:
//! printable ASCII as is, `\\` for a backslash, `\ooo` octal for anything else) when the server
//! or database is configured so. Both are decoded here, once, for every caller (the live
//! stream, the table reader's synthetic messages, parking), bounds-checked: text that is not
//! bytea output is an error naming the offset, never a panic or a guess.

use thiserror::Error;

/// Text that is not Postgres's output for a `bytea` value.
#[derive(Debug, Clone, Copy, Error, PartialEq, Eq)]
#[error("not bytea output at byte {at}: {why}")]
pub struct BadBytea {
    pub at: usize,
    pub why: &'static str,
}

/// The bytes a `bytea` value's text output stands for.
pub fn decode(text: &[u8]) -> Result<Vec<u8>, BadBytea> {
    match text {
        [b'\\', b'x', hex @ ..] => decode_hex(hex),
        _ => decode_escape(text),
    }
}

fn nibble(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

fn decode_hex(hex: &[u8]) -> Result<Vec<u8>, BadBytea> {
    if !hex.len().is_multiple_of(2) {
        return Err(BadBytea {
            at: 2 + hex.len(),
            why: "odd number of hex digits",
        });
    }
    hex.chunks_exact(2)
        .enumerate()
        .map(|(i, pair)| match (nibble(pair[0]), nibble(pair[1])) {
            (Some(h), Some(l)) => Ok(h << 4 | l),
            _ => Err(BadBytea {
                at: 2 + 2 * i,
                why: "not a hex digit",
            }),
        })
        .collect()
}

fn decode_escape(text: &[u8]) -> Result<Vec<u8>, BadBytea> {
    let mut out = Vec::with_capacity(text.len());
    let mut i = 0;
    while i < text.len() {
        if text[i] != b'\\' {
            out.push(text[i]);
            i += 1;
            continue;
        }
        match text.get(i + 1..i + 4) {
            _ if text.get(i + 1) == Some(&b'\\') => {
                out.push(b'\\');
                i += 2;
            }
            Some(&[a @ b'0'..=b'3', b @ b'0'..=b'7', c @ b'0'..=b'7']) => {
                out.push((a - b'0') << 6 | (b - b'0') << 3 | (c - b'0'));
                i += 4;
            }
            _ => {
                return Err(BadBytea {
                    at: i,
                    why: "a backslash not followed by a backslash or three octal digits",
                })
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_output_decodes_to_its_bytes() {
        assert_eq!(decode(b"\\x").unwrap(), b"");
        assert_eq!(decode(b"\\x00ff5C41").unwrap(), [0, 0xff, b'\\', b'A']);
        let all: Vec<u8> = (0..=255).collect();
        let text: String = all.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(decode(format!("\\x{text}").as_bytes()).unwrap(), all);
    }

    #[test]
    fn escape_output_decodes_to_its_bytes() {
        assert_eq!(decode(b"").unwrap(), b"");
        assert_eq!(
            decode(b"ab\\\\c\\000\\377\\134").unwrap(),
            [b'a', b'b', b'\\', b'c', 0, 0xff, b'\\']
        );
    }

    #[test]
    fn malformed_text_is_an_error_naming_where() {
        assert_eq!(decode(b"\\x0").unwrap_err().at, 3);
        assert_eq!(decode(b"\\x0g").unwrap_err().at, 2);
        assert_eq!(decode(b"\\x00zz").unwrap_err().at, 4);
        assert_eq!(decode(b"a\\").unwrap_err().at, 1);
        assert_eq!(decode(b"\\400").unwrap_err().at, 0);
        assert_eq!(decode(b"\\12").unwrap_err().at, 0);
    }
}
