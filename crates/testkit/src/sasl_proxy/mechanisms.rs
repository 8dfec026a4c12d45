//! The SASL mechanisms the proxy speaks, server side: PLAIN (RFC 4616), OAUTHBEARER (RFC 7628)
//! and SCRAM-SHA-256/512 (RFC 5802, RFC 7677).

use super::*;

/// PLAIN (RFC 4616): `authzid \0 user \0 password`.
pub(super) fn plain(sh: &Shared, bytes: &[u8]) -> Step {
    let parts: Vec<&[u8]> = bytes.split(|b| *b == 0).collect();
    let [authzid, user, password] = parts[..] else {
        return Step::Fail("Authentication failed: invalid SASL/PLAIN message".into());
    };
    let (user, password) = (
        String::from_utf8_lossy(user).into_owned(),
        String::from_utf8_lossy(password).into_owned(),
    );
    if !authzid.is_empty() && authzid != user.as_bytes() {
        return Step::Fail(
            "Authentication failed: Client requested an authorization id that is different \
             from username"
                .into(),
        );
    }
    let ok = sh
        .users
        .lock()
        .unwrap()
        .get(&user)
        .is_some_and(|u| u.password == password);
    if ok {
        Step::Done {
            bytes: vec![],
            principal: user,
            extensions: None,
        }
    } else {
        Step::Fail(String::new())
    }
}

/// OAUTHBEARER (RFC 7628) client initial response:
/// `n,,\x01auth=Bearer <token>\x01[key=value\x01]*\x01`.
pub(super) fn oauthbearer(sh: &Shared, bytes: &[u8]) -> Step {
    let Some((token, extensions)) = parse_oauthbearer(&String::from_utf8_lossy(bytes)) else {
        return Step::Fail("Authentication failed: invalid OAUTHBEARER client response".into());
    };
    let ok = sh.any_token.load(Ordering::SeqCst) || sh.tokens.lock().unwrap().contains(&token);
    if !ok {
        return Step::Fail(String::new());
    }
    Step::Done {
        bytes: vec![],
        principal: jwt_sub(&token).unwrap_or_else(|| "token".into()),
        extensions: Some(extensions),
    }
}

/// (token, extensions) of an OAUTHBEARER client initial response.
pub(super) fn parse_oauthbearer(msg: &str) -> Option<(String, Vec<(String, String)>)> {
    let (gs2, rest) = msg.split_once('\x01')?;
    if !gs2.starts_with("n,") && !gs2.starts_with("y,") {
        return None;
    }
    let mut token = None;
    let mut extensions = vec![];
    for kv in rest.split('\x01').filter(|kv| !kv.is_empty()) {
        let (k, v) = kv.split_once('=')?;
        if k == "auth" {
            let (scheme, t) = v.split_once(' ')?;
            if !scheme.eq_ignore_ascii_case("bearer") {
                return None;
            }
            token = Some(t.trim().to_string());
        } else {
            extensions.push((k.to_string(), v.to_string()));
        }
    }
    Some((token?, extensions))
}

/// The `sub` claim of a JWT-shaped token (not verified: the proxy trusts its allow list).
pub(crate) fn jwt_sub(token: &str) -> Option<String> {
    let payload = token.split('.').nth(1)?;
    let json = B64URL.decode(payload.trim_end_matches('=')).ok()?;
    let v: serde_json::Value = serde_json::from_slice(&json).ok()?;
    v.get("sub")?.as_str().map(str::to_string)
}

#[derive(Clone, Copy, Debug)]
pub(super) enum ScramHash {
    Sha256 = 0,
    Sha512 = 1,
}

impl ScramHash {
    pub(super) fn hmac(self, key: &[u8], data: &[u8]) -> Vec<u8> {
        match self {
            Self::Sha256 => {
                let mut m = Hmac::<Sha256>::new_from_slice(key).expect("any key length");
                m.update(data);
                m.finalize().into_bytes().to_vec()
            }
            Self::Sha512 => {
                let mut m = Hmac::<Sha512>::new_from_slice(key).expect("any key length");
                m.update(data);
                m.finalize().into_bytes().to_vec()
            }
        }
    }

    pub(super) fn h(self, data: &[u8]) -> Vec<u8> {
        match self {
            Self::Sha256 => Sha256::digest(data).to_vec(),
            Self::Sha512 => Sha512::digest(data).to_vec(),
        }
    }

    pub(super) fn salted_password(self, password: &str, salt: &[u8], iterations: u32) -> Vec<u8> {
        match self {
            Self::Sha256 => {
                let mut out = [0u8; 32];
                pbkdf2::pbkdf2_hmac::<Sha256>(password.as_bytes(), salt, iterations, &mut out);
                out.to_vec()
            }
            Self::Sha512 => {
                let mut out = [0u8; 64];
                pbkdf2::pbkdf2_hmac::<Sha512>(password.as_bytes(), salt, iterations, &mut out);
                out.to_vec()
            }
        }
    }
}

/// The server's SCRAM state between the two round trips (RFC 5802).
pub(super) struct ScramFirst {
    pub(super) hash: ScramHash,
    pub(super) user: String,
    pub(super) salted: Vec<u8>,
    gs2_header: String,
    pub(super) client_first_bare: String,
    pub(super) server_first: String,
    pub(super) nonce: String,
}

/// Checks the client-first message (`n,,n=user,r=cnonce`) and builds the server-first one.
/// `lookup` gives a user's (salt, salted password); an unknown user fails here (as Kafka). `Err`:
/// the failure message (empty: the generic invalid-credentials one).
pub(super) fn scram_first(
    hash: ScramHash,
    msg: &str,
    lookup: impl FnOnce(&str) -> Option<(Vec<u8>, Vec<u8>)>,
    snonce: &str,
    iterations: u32,
) -> std::result::Result<ScramFirst, String> {
    let malformed = || "Authentication failed: invalid SCRAM client-first message".to_string();
    let mut it = msg.splitn(3, ',');
    let (Some(cbind), Some(_authzid), Some(bare)) = (it.next(), it.next(), it.next()) else {
        return Err(malformed());
    };
    if cbind != "n" && cbind != "y" {
        return Err("Authentication failed: SCRAM channel binding is not supported".into());
    }
    let gs2_header = msg[..msg.len() - bare.len()].to_string();
    let mut user = None;
    let mut cnonce = None;
    for attr in bare.split(',') {
        if let Some(v) = attr.strip_prefix("n=") {
            user = Some(v.replace("=2C", ",").replace("=3D", "="));
        } else if let Some(v) = attr.strip_prefix("r=") {
            cnonce = Some(v.to_string());
        }
    }
    let (Some(user), Some(cnonce)) = (user, cnonce) else {
        return Err(malformed());
    };
    let Some((salt, salted)) = lookup(&user) else {
        return Err(String::new());
    };
    let nonce = format!("{cnonce}{snonce}");
    let server_first = format!("r={nonce},s={},i={iterations}", B64.encode(&salt));
    Ok(ScramFirst {
        hash,
        salted,
        user,
        gs2_header,
        client_first_bare: bare.to_string(),
        server_first,
        nonce,
    })
}

/// Verifies the client-final message (`c=biws,r=nonce,p=proof`) and builds the server-final
/// one (`v=signature`).
pub(super) fn scram_final(first: &ScramFirst, msg: &str) -> std::result::Result<String, String> {
    let malformed = || "Authentication failed: invalid SCRAM client-final message".to_string();
    let Some(idx) = msg.rfind(",p=") else {
        return Err(malformed());
    };
    let (without_proof, proof) = (&msg[..idx], &msg[idx + 3..]);
    let Ok(proof) = B64.decode(proof) else {
        return Err(malformed());
    };
    let mut cbind = None;
    let mut nonce = None;
    for attr in without_proof.split(',') {
        if let Some(v) = attr.strip_prefix("c=") {
            cbind = Some(v);
        } else if let Some(v) = attr.strip_prefix("r=") {
            nonce = Some(v);
        }
    }
    if cbind != Some(B64.encode(&first.gs2_header).as_str()) || nonce != Some(&first.nonce) {
        return Err(malformed());
    }
    let h = first.hash;
    let auth_message = format!(
        "{},{},{without_proof}",
        first.client_first_bare, first.server_first
    );
    let client_key = h.hmac(&first.salted, b"Client Key");
    let stored_key = h.h(&client_key);
    let client_signature = h.hmac(&stored_key, auth_message.as_bytes());
    if proof.len() != client_signature.len() {
        return Err(String::new());
    }
    let recovered: Vec<u8> = proof
        .iter()
        .zip(&client_signature)
        .map(|(a, b)| a ^ b)
        .collect();
    if h.h(&recovered) != stored_key {
        return Err(String::new());
    }
    let server_key = h.hmac(&first.salted, b"Server Key");
    Ok(format!(
        "v={}",
        B64.encode(h.hmac(&server_key, auth_message.as_bytes()))
    ))
}
