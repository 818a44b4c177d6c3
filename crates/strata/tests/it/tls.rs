//! TLS and keys, with real processes on 127.0.0.1: shards and a drafter that serve TLS, shards
//! that verify the next shard against a CA, a tracker that verifies them all and serves its API
//! over HTTPS; plaintext and strangers are refused. With an API key, `/health` and `/metrics` need it too unless
//! `--public-metrics` opens them.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use testkit::http::{get, post_json, request};
use testkit::procs::{self, Proc};
use tokio_rustls::rustls;

fn exe() -> &'static Path {
    procs::strata_bin(env!("CARGO_BIN_EXE_strata"))
}

static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn dir(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("strata-tls-{}-{name}", std::process::id()))
}

/// One HTTP/1.1 request over TLS that trusts only `ca`: the status and body, or the error.
fn https(
    addr: &str,
    ca: &Path,
    method: &str,
    path: &str,
    body: &str,
) -> Result<(u16, String), String> {
    let mut roots = rustls::RootCertStore::empty();
    let pem = std::fs::read(ca).unwrap();
    use rustls::pki_types::pem::PemObject;
    for c in rustls::pki_types::CertificateDer::pem_slice_iter(&pem) {
        roots.add(c.unwrap()).unwrap();
    }
    let config = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let host = addr.rsplit_once(':').unwrap().0.to_string();
    let name = rustls::pki_types::ServerName::try_from(host).unwrap();
    let conn = rustls::ClientConnection::new(Arc::new(config), name).map_err(|e| e.to_string())?;
    let tcp = TcpStream::connect(addr).map_err(|e| e.to_string())?;
    tcp.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut tls = rustls::StreamOwned::new(conn, tcp);
    let req = format!(
        "{method} {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    tls.write_all(req.as_bytes()).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    let _ = tls.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("no HTTP response: {text:?}"))?;
    let body = text
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    Ok((status, body))
}

fn tls_shard(m: &Path, layers: &str, token: &Path, certs: &testkit::tls::TestCerts) -> Proc {
    let (cert, key, ca) = (
        certs.cert.display().to_string(),
        certs.key.display().to_string(),
        certs.ca.display().to_string(),
    );
    procs::shard(
        exe(),
        m,
        layers,
        token,
        &[
            "--threads",
            "1",
            "--tls-cert",
            &cert,
            "--tls-key",
            &key,
            "--tls-ca",
            &ca,
        ],
    )
}

#[test]
fn a_cluster_with_tls_answers_and_refuses_plaintext_and_strangers() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let d = dir("cluster");
    let cluster = testkit::tls::test_certs(&d, "cluster");
    let api = testkit::tls::test_certs(&d, "api");
    let stranger = testkit::tls::test_certs(&d, "stranger");
    let token = procs::token_file("tls-cluster-token-0123456789");
    let m = testkit::real_model();
    let a = tls_shard(&m, "0..15", &token, &cluster);
    let b = tls_shard(&m, "15..30", &token, &cluster);
    let drafter = procs::spawn(
        exe(),
        &[
            "drafter".to_string(),
            "--model".into(),
            m.display().to_string(),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--cluster-token-file".into(),
            token.display().to_string(),
            "--threads".into(),
            "1".into(),
            "--tls-cert".into(),
            cluster.cert.display().to_string(),
            "--tls-key".into(),
            cluster.key.display().to_string(),
        ],
        "strata drafter listening on ",
        "drafter",
    );
    let (ca, cert, key) = (
        cluster.ca.display().to_string(),
        api.cert.display().to_string(),
        api.key.display().to_string(),
    );
    let t = procs::tracker(
        exe(),
        &[&a, &b],
        &token,
        &[
            "--tls-ca",
            &ca,
            "--tls-cert",
            &cert,
            "--tls-key",
            &key,
            "--drafter",
            &drafter.addr,
        ],
    );
    // Over HTTPS, trusting the API's CA: answered, through shard links that are TLS too.
    let body = json!({"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
        .to_string();
    let (status, text) = https(&t.addr, &api.ca, "POST", "/v1/completions", &body).unwrap();
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 8, "{v}");
    // Its decode steps verified drafts from the drafter, reached over TLS.
    let (status, metrics) = https(&t.addr, &api.ca, "GET", "/metrics", "").unwrap();
    assert_eq!(status, 200);
    let drafted: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("strata_spec_drafted_tokens_total{drafter=\"model\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(drafted > 0.0, "no drafts from the TLS drafter:\n{metrics}");
    // Trusting another CA, the API is refused; plain HTTP gets no answer.
    assert!(https(&t.addr, &stranger.ca, "GET", "/health", "").is_err());
    assert!(request("GET", &t.addr, "/health", None, &[]).map_or(true, |r| r.status == 0));
    // A plaintext gRPC client, or one trusting another CA, is refused by a TLS shard.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        use proto::ShardTransport;
        let tok = "tls-cluster-token-0123456789";
        let plain = proto::connect(&a.addr, &proto::Link::plain(tok)).unwrap();
        assert!(plain.describe(Duration::from_secs(3)).await.is_err());
        let other = proto::Link {
            token: tok.into(),
            ca_pem: Some(std::fs::read(&stranger.ca).unwrap()),
        };
        let e = proto::connect(&a.addr, &other).unwrap();
        assert!(e.describe(Duration::from_secs(3)).await.is_err());
        let right = proto::Link {
            token: tok.into(),
            ca_pem: Some(std::fs::read(&cluster.ca).unwrap()),
        };
        let ok = proto::connect(&a.addr, &right).unwrap();
        assert_eq!(
            ok.describe(Duration::from_secs(3)).await.unwrap().layer_end,
            15
        );
    });
    // A tracker trusting another CA cannot reach the shards and says so.
    let out = Command::new(exe())
        .args([
            "tracker",
            "--shards",
            &format!("{},{}", a.addr, b.addr),
            "--listen",
            "127.0.0.1:0",
            "--cluster-token-file",
            token.to_str().unwrap(),
            "--tls-ca",
            stranger.ca.to_str().unwrap(),
            "--startup-wait-ms",
            "3000",
        ])
        .output()
        .unwrap();
    assert_ne!(out.status.code(), Some(0));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("did not answer"), "{err}");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn with_an_api_key_health_and_metrics_need_it_unless_public() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let m = testkit::real_model();
    let key = "sk-test-0123456789abcdef";
    for public in [false, true] {
        let mut args = vec![
            "serve".to_string(),
            "--model".into(),
            m.display().to_string(),
            "--shards".into(),
            "1".into(),
            "--threads".into(),
            "1".into(),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--api-key".into(),
            key.into(),
        ];
        if public {
            args.push("--public-metrics".into());
        }
        let t = procs::spawn(exe(), &args, "strata tracker listening on ", "serve");
        let auth = format!("Bearer {key}");
        let with = [("authorization", auth.as_str())];
        let wrong = [("authorization", "Bearer sk-not-the-key-000000")];
        for path in ["/health", "/metrics"] {
            let open = get(&t.addr, path).status;
            assert_eq!(
                open,
                if public { 200 } else { 401 },
                "{path} public={public}"
            );
            assert_eq!(
                request("GET", &t.addr, path, None, &with).unwrap().status,
                200
            );
        }
        let body = json!({"prompt": "Hi", "max_tokens": 2});
        assert_eq!(post_json(&t.addr, "/v1/completions", &body).status, 401);
        let r = request("POST", &t.addr, "/v1/completions", Some(&body), &wrong).unwrap();
        assert_eq!(r.status, 401);
        let r = request("POST", &t.addr, "/v1/completions", Some(&body), &with).unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
    }
}

/// etcd over TLS that asks every client for a certificate: shards and a tracker given the CA
/// and a client certificate announce, follow and answer; a tracker given only the CA is
/// refused by etcd (no member, no route), and one given `https://` without a CA, or a CA for
/// an `http://` endpoint, does not start.
#[test]
fn etcd_over_tls_with_client_certificates_carries_the_membership() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let d = dir("etcd");
    let certs = testkit::tls::test_certs(&d, "etcd");
    let etcd = testkit::etcd::Etcd::start_tls(&certs);
    let ep = etcd.endpoint();
    assert!(ep.starts_with("https://"), "{ep}");
    let token = procs::token_file("etcd-tls-token-0123456789abcdef");
    let m = testkit::real_model();
    let (ca, cert, key) = (
        certs.ca.display().to_string(),
        certs.cert.display().to_string(),
        certs.key.display().to_string(),
    );
    let tls_flags = [
        "--registry-ca",
        ca.as_str(),
        "--registry-cert",
        cert.as_str(),
        "--registry-key",
        key.as_str(),
    ];
    let _shards: Vec<Proc> = ["0..15", "15..30"]
        .iter()
        .map(|r| procs::announced(exe(), &m, r, &token, "127.0.0.1:0", &ep, &tls_flags))
        .collect();
    let tracker = procs::registry_tracker(exe(), &token, &ep, &tls_flags);
    let body = json!({"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0});
    let answered = testkit::observe::wait_until(Duration::from_secs(30), || {
        request("POST", &tracker.addr, "/v1/completions", Some(&body), &[])
            .is_ok_and(|r| r.status == 200)
    });
    assert!(answered, "no route formed over the TLS registry");
    let h: Value = get(&tracker.addr, "/health").json();
    assert_eq!(
        h["models"][0]["routes"].as_array().map(Vec::len),
        Some(1),
        "{h}"
    );

    // The CA alone: etcd wants a client certificate, so nothing is seen.
    let stranger = procs::registry_tracker(exe(), &token, &ep, &["--registry-ca", &ca]);
    std::thread::sleep(Duration::from_secs(3));
    let ready = get(&stranger.addr, "/readyz");
    assert_eq!(ready.status, 503, "{}", ready.body);
    assert_eq!(
        testkit::observe::tracker_metric(&stranger.addr, "strata_registry_connected"),
        0.0
    );

    // Mixed-up schemes are refused at start, naming the flag.
    for (endpoint, extra) in [
        (ep.as_str(), &[][..]),
        (
            &*ep.replacen("https://", "http://", 1),
            &["--registry-ca", ca.as_str()][..],
        ),
    ] {
        let mut args = vec![
            "tracker".to_string(),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--cluster-token-file".into(),
            token.display().to_string(),
            "--registry".into(),
            endpoint.to_string(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let out = Command::new(exe()).args(&args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{endpoint} {extra:?}: started");
        assert!(
            err.contains("--registry-ca") || err.contains("must be https://"),
            "{endpoint} {extra:?}: {err}"
        );
    }
}

/// etcd with authentication on: shards and a tracker given the user and its password file
/// announce, follow and answer; a tracker without them sees no member.
#[test]
fn etcd_with_a_user_and_password_carries_the_membership() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let d = dir("etcd-auth");
    std::fs::create_dir_all(&d).unwrap();
    let etcd = testkit::etcd::Etcd::start();
    etcd.enable_auth("s3cret-pass");
    let pw = d.join("password");
    std::fs::write(&pw, "s3cret-pass\n").unwrap();
    let pw = pw.display().to_string();
    let ep = etcd.endpoint();
    let token = procs::token_file("etcd-auth-token-0123456789abcdef");
    let m = testkit::real_model();
    let auth = [
        "--registry-user",
        "root",
        "--registry-password-file",
        pw.as_str(),
    ];
    let _shard = procs::announced(exe(), &m, "0..30", &token, "127.0.0.1:0", &ep, &auth);
    let tracker = procs::registry_tracker(exe(), &token, &ep, &auth);
    let body = json!({"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0});
    let answered = testkit::observe::wait_until(Duration::from_secs(30), || {
        request("POST", &tracker.addr, "/v1/completions", Some(&body), &[])
            .is_ok_and(|r| r.status == 200)
    });
    assert!(answered, "no route formed over the authenticated registry");

    let stranger = procs::registry_tracker(exe(), &token, &ep, &[]);
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(get(&stranger.addr, "/readyz").status, 503);
    assert_eq!(
        testkit::observe::tracker_metric(&stranger.addr, "strata_registry_connected"),
        0.0
    );
}
