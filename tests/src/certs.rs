//! A private certificate authority for TLS tests (rcgen).

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};

pub struct Ca {
    pub cert: rcgen::Certificate,
    key: KeyPair,
}

impl Ca {
    pub fn new(name: &str) -> anyhow::Result<Self> {
        let mut p = CertificateParams::new(Vec::<String>::new())?;
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.distinguished_name.push(DnType::CommonName, name);
        let key = KeyPair::generate()?;
        Ok(Self {
            cert: p.self_signed(&key)?,
            key,
        })
    }

    /// Signs `p` with a fresh key: (certificate, key) PEM.
    pub fn sign(&self, p: CertificateParams) -> anyhow::Result<(String, String)> {
        let key = KeyPair::generate()?;
        let cert = p.signed_by(&key, &self.cert, &self.key)?;
        Ok((cert.pem(), key.serialize_pem()))
    }

    /// A server certificate for `names` (DNS names or IP addresses).
    pub fn server(&self, names: &[&str]) -> anyhow::Result<(String, String)> {
        self.sign(CertificateParams::new(
            names.iter().map(|n| n.to_string()).collect::<Vec<_>>(),
        )?)
    }
}
