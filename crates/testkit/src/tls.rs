//! Certificates for tests: a fresh certificate authority and certificates it signed for
//! 127.0.0.1 and localhost, written as PEM files.

use std::path::{Path, PathBuf};

/// PEM files of one test CA and one certificate (with its key) it signed.
#[derive(Debug, Clone)]
pub struct TestCerts {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// A new CA named `name` and a certificate for 127.0.0.1 and localhost signed by it, under
/// `dir`.
pub fn test_certs(dir: &Path, name: &str) -> TestCerts {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
    std::fs::create_dir_all(dir).expect("cert dir");
    let ca_key = KeyPair::generate().expect("CA key");
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, format!("{name} test CA"));
    let ca = ca_params.self_signed(&ca_key).expect("CA certificate");
    let key = KeyPair::generate().expect("key");
    let params = CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()])
        .expect("params");
    let cert = params.signed_by(&key, &ca, &ca_key).expect("certificate");
    let out = TestCerts {
        ca: dir.join(format!("{name}-ca.pem")),
        cert: dir.join(format!("{name}-cert.pem")),
        key: dir.join(format!("{name}-key.pem")),
    };
    std::fs::write(&out.ca, ca.pem()).expect("write CA");
    std::fs::write(&out.cert, cert.pem()).expect("write cert");
    std::fs::write(&out.key, key.serialize_pem()).expect("write key");
    out
}
