//! Certificates made at test time (rcgen): a CA, and server or client certificates it signs,
//! written as PEM files for warmpath's policy files and for clients (curl, the openai SDK).

use std::path::{Path, PathBuf};

use rcgen::{BasicConstraints, Certificate, CertificateParams, DnType, IsCa, KeyPair};

/// A certificate authority whose certificate is `ca.pem` in its directory.
pub struct TestCa {
    cert: Certificate,
    key: KeyPair,
    dir: PathBuf,
}

/// A certificate and key on disk.
pub struct CertFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl TestCa {
    pub fn new(dir: &Path, name: &str) -> TestCa {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, format!("warmpath test CA {name}"));
        let key = KeyPair::generate().expect("key");
        let cert = params.self_signed(&key).expect("CA");
        let dir = dir.join(name);
        std::fs::create_dir_all(&dir).expect("dir");
        std::fs::write(dir.join("ca.pem"), cert.pem()).expect("write");
        TestCa { cert, key, dir }
    }

    pub fn ca_file(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    /// A certificate for `names` (DNS names or IP addresses), `file`.pem and `file`-key.pem;
    /// `expired`: it ended yesterday.
    pub fn issue(&self, file: &str, names: &[&str], expired: bool) -> CertFiles {
        let mut params =
            CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>()).expect("params");
        params.distinguished_name.push(DnType::CommonName, names.first().copied().unwrap_or("client"));
        if expired {
            params.not_before = rcgen::date_time_ymd(2020, 1, 1);
            params.not_after = rcgen::date_time_ymd(2021, 1, 1);
        }
        let key = KeyPair::generate().expect("key");
        let cert = params.signed_by(&key, &self.cert, &self.key).expect("signed");
        let files = CertFiles {
            cert: self.dir.join(format!("{file}.pem")),
            key: self.dir.join(format!("{file}-key.pem")),
        };
        std::fs::write(&files.cert, cert.pem()).expect("write");
        std::fs::write(&files.key, key.serialize_pem()).expect("write");
        files
    }
}
