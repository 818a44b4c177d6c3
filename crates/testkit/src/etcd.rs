//! A real etcd for tests: one member on free 127.0.0.1 ports (or on a test host's address, in its
//! network namespace: [`Etcd::start_on`]) with a temporary data directory,
//! killed (and its directory removed) when the handle drops. The binary is `ETCD_BIN`, else
//! `etcd` on the PATH (Debian's `etcd-server`; `.ci/run` installs it).

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running (or stopped, to be restarted) etcd.
pub struct Etcd {
    child: Option<Child>,
    dir: PathBuf,
    client_port: u16,
    peer_port: u16,
    /// With TLS: its certificates (clients must present one signed by the same CA), and the
    /// clear-text port of its `/health` (etcd's metrics listener).
    tls: Option<(crate::tls::TestCerts, u16)>,
    /// Where it runs: the address it listens on, and the host whose namespace it runs in.
    ip: String,
    host: Option<crate::net::Host>,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port on 127.0.0.1")
        .port()
}

fn binary() -> PathBuf {
    std::env::var_os("ETCD_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("etcd"))
}

impl Etcd {
    /// Starts etcd and waits until it answers.
    pub fn start() -> Etcd {
        Etcd::start_with(None, None)
    }

    /// Starts etcd on `host` (in its network namespace, on its address) and waits until it
    /// answers.
    pub fn start_on(host: &crate::net::Host) -> Etcd {
        Etcd::start_with(None, Some(host.clone()))
    }

    /// Starts etcd serving its clients over TLS only, with `certs` (a certificate for
    /// 127.0.0.1), and asking every client for a certificate signed by `certs.ca`
    /// (`--client-cert-auth`).
    pub fn start_tls(certs: &crate::tls::TestCerts) -> Etcd {
        Etcd::start_with(Some(certs.clone()), None)
    }

    fn start_with(tls: Option<crate::tls::TestCerts>, host: Option<crate::net::Host>) -> Etcd {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("strata-etcd-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("etcd data dir");
        let mut e = Etcd {
            child: None,
            dir,
            client_port: 0,
            peer_port: 0,
            tls: None,
            ip: host.as_ref().map_or("127.0.0.1".into(), |h| h.ip.clone()),
            host,
        };
        // A port found free may be taken before etcd binds it: then other ports.
        for attempt in 1..=3 {
            e.client_port = free_port();
            e.peer_port = free_port();
            e.tls = tls.clone().map(|c| (c, free_port()));
            match e.launch() {
                Ok(()) => return e,
                Err(why) if attempt < 3 => eprintln!("etcd did not start ({why}); other ports"),
                Err(why) => panic!("{why}"),
            }
        }
        unreachable!("the last attempt returns or panics")
    }

    /// `http://127.0.0.1:PORT` (`https://` with TLS; its host's address on a host), what
    /// `--registry` takes.
    pub fn endpoint(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{}:{}", self.ip, self.client_port)
    }

    /// Kills etcd (SIGKILL), keeping its data for [`Etcd::restart`].
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts etcd again on the same ports and data (after [`Etcd::kill`]) and waits until it
    /// answers.
    pub fn restart(&mut self) {
        if let Err(why) = self.launch() {
            panic!("{why}");
        }
    }

    /// Starts etcd on this handle's ports and data and waits until it answers.
    fn launch(&mut self) -> Result<(), String> {
        self.kill();
        let client = self.endpoint();
        let peer = format!("http://{}:{}", self.ip, self.peer_port);
        let mut cmd = match &self.host {
            Some(host) => host.command(&binary()),
            None => Command::new(binary()),
        };
        let mut health = format!("{}:{}", self.ip, self.client_port);
        if let Some((certs, metrics_port)) = &self.tls {
            let file = |p: &PathBuf| p.display().to_string();
            health = format!("{}:{metrics_port}", self.ip);
            cmd.args(["--cert-file", &file(&certs.cert)])
                .args(["--key-file", &file(&certs.key)])
                .args(["--trusted-ca-file", &file(&certs.ca)])
                .arg("--client-cert-auth")
                .args(["--listen-metrics-urls", &format!("http://{health}")]);
        }
        let child = cmd
            .args([
                "--name",
                "strata-test",
                "--data-dir",
                &self.dir.join("data").display().to_string(),
                "--listen-client-urls",
                &client,
                "--advertise-client-urls",
                &client,
                "--listen-peer-urls",
                &peer,
                "--initial-advertise-peer-urls",
                &peer,
                "--initial-cluster",
                &format!("strata-test={peer}"),
            ])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(self.dir.join("etcd.log")).expect("etcd log"))
            .stdin(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "start etcd ({}): {e}; install Debian's etcd-server or set ETCD_BIN",
                    binary().display()
                )
            });
        self.child = Some(child);
        let t0 = Instant::now();
        loop {
            let r = client::request("GET", &health, "/health", None, &[]);
            if r.is_ok_and(|r| r.status == 200 && r.body.contains("true")) {
                return Ok(());
            }
            let log = || std::fs::read_to_string(self.dir.join("etcd.log")).unwrap_or_default();
            if let Some(Ok(Some(status))) = self.child.as_mut().map(|c| c.try_wait()) {
                self.child = None;
                return Err(format!("etcd exited ({status}):\n{}", log()));
            }
            if t0.elapsed() > Duration::from_secs(30) {
                return Err(format!("etcd did not answer within 30 s:\n{}", log()));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// One call of etcd's JSON gateway.
    fn gateway(&self, path: &str, body: &serde_json::Value) -> serde_json::Value {
        let addr = format!("{}:{}", self.ip, self.client_port);
        let r = client::request("POST", &addr, path, Some(body), &[]).expect("etcd gateway");
        serde_json::from_str(&r.body).unwrap_or_default()
    }

    /// Turns authentication on, with one user, `root` (etcd's root role) with `password`,
    /// through the JSON gateway (whose other helpers then fail: they send no token).
    pub fn enable_auth(&self, password: &str) {
        use serde_json::json;
        self.gateway(
            "/v3/auth/user/add",
            &json!({"name": "root", "password": password}),
        );
        // The root role may exist already; adding it again is refused, harmlessly.
        self.gateway("/v3/auth/role/add", &json!({"name": "root"}));
        self.gateway(
            "/v3/auth/user/grant",
            &json!({"user": "root", "role": "root"}),
        );
        let on = self.gateway("/v3/auth/enable", &json!({}));
        assert!(on.get("error").is_none(), "etcd auth enable: {on}");
    }

    /// Writes `value` under `key` with no lease (as an operator's `etcdctl put` would).
    pub fn put(&self, key: &str, value: &[u8]) {
        use base64::Engine;
        let b64 = |s: &[u8]| base64::engine::general_purpose::STANDARD.encode(s);
        self.gateway(
            "/v3/kv/put",
            &serde_json::json!({"key": b64(key.as_bytes()), "value": b64(value)}),
        );
    }

    /// Deletes `key` (as `etcdctl del` would).
    pub fn delete(&self, key: &str) {
        use base64::Engine;
        let b64 = |s: &[u8]| base64::engine::general_purpose::STANDARD.encode(s);
        self.gateway(
            "/v3/kv/deleterange",
            &serde_json::json!({"key": b64(key.as_bytes())}),
        );
    }

    /// The value under `key` and the lease it is bound to (0: none), if there is one.
    pub fn get(&self, key: &str) -> Option<(Vec<u8>, i64)> {
        use base64::Engine;
        let engine = base64::engine::general_purpose::STANDARD;
        let v = self.gateway(
            "/v3/kv/range",
            &serde_json::json!({"key": engine.encode(key.as_bytes())}),
        );
        let kv = v["kvs"].as_array()?.first()?;
        let value = engine.decode(kv["value"].as_str().unwrap_or("")).ok()?;
        // The gateway writes 64-bit integers as strings.
        let lease = kv["lease"]
            .as_str()
            .and_then(|l| l.parse().ok())
            .or_else(|| kv["lease"].as_i64())
            .unwrap_or(0);
        Some((value, lease))
    }

    /// The keys under `prefix` (through etcd's JSON gateway), for checks.
    pub fn keys(&self, prefix: &str) -> Vec<String> {
        use base64::Engine;
        let b64 = |s: &[u8]| base64::engine::general_purpose::STANDARD.encode(s);
        let unbase64 = |s: &str| {
            base64::engine::general_purpose::STANDARD
                .decode(s)
                .ok()
                .and_then(|b| String::from_utf8(b).ok())
        };
        let mut end = prefix.as_bytes().to_vec();
        if let Some(last) = end.last_mut() {
            *last += 1;
        }
        let body = serde_json::json!({"key": b64(prefix.as_bytes()), "range_end": b64(&end), "keys_only": true});
        let addr = format!("{}:{}", self.ip, self.client_port);
        let r =
            client::request("POST", &addr, "/v3/kv/range", Some(&body), &[]).expect("etcd range");
        let v: serde_json::Value = serde_json::from_str(&r.body).unwrap_or_default();
        v["kvs"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|kv| kv["key"].as_str().and_then(unbase64))
                    .collect()
            })
            .unwrap_or_default()
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
