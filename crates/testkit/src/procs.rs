//! Real `strata` processes for integration tests, on 127.0.0.1 with free ports; each is killed
//! when its handle drops.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// The strata binary under test: `STRATA_TEST_BIN` when set (to run the scenarios against
/// another build, such as the commit before a fix), else `built`, the one cargo built.
pub fn strata_bin(built: &'static str) -> &'static Path {
    static BIN: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BIN.get_or_init(|| {
        std::env::var_os("STRATA_TEST_BIN")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(built))
    })
}

/// A running child process and the address it printed.
pub struct Proc {
    pub child: Child,
    pub addr: String,
    pub name: String,
}

impl Proc {
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Sends a signal (e.g. `libc`-style 9 for SIGKILL, 19 for SIGSTOP, 18 for SIGCONT).
    pub fn signal(&self, sig: i32) {
        let status = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(self.pid().to_string())
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{sig} {} failed", self.pid());
    }

    /// Whether the process has exited.
    pub fn exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // (A frozen process must be woken to die; one that is gone already needs nothing.)
        let _ = Command::new("kill")
            .arg("-18")
            .arg(self.child.id().to_string())
            .stderr(Stdio::null())
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The child processes of `pid`, started by any of its threads (Linux).
pub fn children(pid: i32) -> Vec<i32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    let mut out: Vec<i32> = tasks
        .flatten()
        .flat_map(|t| {
            std::fs::read_to_string(t.path().join("children"))
                .unwrap_or_default()
                .split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect::<Vec<i32>>()
        })
        .collect();
    out.sort_unstable();
    out
}

/// Starts `exe args...` and waits until it prints a line starting with `ready_prefix`; the
/// address is the first word after the prefix.
pub fn spawn(exe: &Path, args: &[String], ready_prefix: &str, name: &str) -> Proc {
    let mut cmd = Command::new(exe);
    cmd.args(args);
    spawn_command(cmd, ready_prefix, name)
}

/// Starts `cmd` and waits until it prints a line starting with `ready_prefix`; the address is
/// the first word after the prefix.
pub fn spawn_command(mut cmd: Command, ready_prefix: &str, name: &str) -> Proc {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .stdin(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("start {name}: {e}"));
    let stdout = child.stdout.take().expect("piped stdout");
    let (tx, rx) = mpsc::channel();
    let prefix = ready_prefix.to_string();
    std::thread::spawn(move || {
        let mut sent = false;
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if !sent {
                if let Some(rest) = line.strip_prefix(&prefix) {
                    let addr = rest
                        .split_whitespace()
                        .next()
                        .unwrap_or("")
                        .trim_start_matches("http://")
                        .trim_start_matches("https://")
                        .to_string();
                    let _ = tx.send(addr);
                    sent = true;
                }
            }
        }
    });
    let addr = match rx.recv_timeout(Duration::from_secs(180)) {
        Ok(a) => a,
        Err(_) => {
            let _ = child.kill();
            panic!("{name} did not become ready");
        }
    };
    Proc {
        child,
        addr,
        name: name.to_string(),
    }
}

/// A cluster token file under the temp dir.
pub fn token_file(token: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("strata-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let p = dir.join(format!("token-{}", token.len()));
    std::fs::write(&p, token).expect("write token");
    p
}

/// API keys and a usage ledger for a tracker, in a fresh folder that goes when this is
/// dropped: [`ApiKeys::flags`] are the tracker's `--ledger` and `--api-keys`.
pub struct ApiKeys {
    dir: PathBuf,
    ledger: String,
    keys: String,
}

impl ApiKeys {
    /// `keys` as (name, secret) pairs, each with a budget no test spends; `tag` names the
    /// folder (unique per test and process).
    pub fn new(tag: &str, keys: &[(&str, &str)]) -> ApiKeys {
        let dir = std::env::temp_dir().join(format!("strata-keys-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("keys dir");
        let lines: String = keys
            .iter()
            .map(|(name, secret)| format!("{name} {secret} 100000000\n"))
            .collect();
        let path = dir.join("keys");
        std::fs::write(&path, lines).expect("write keys");
        ApiKeys {
            ledger: dir.join("ledger.sqlite").display().to_string(),
            keys: path.display().to_string(),
            dir,
        }
    }

    pub fn flags(&self) -> [&str; 4] {
        ["--ledger", &self.ledger, "--api-keys", &self.keys]
    }
}

impl Drop for ApiKeys {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Starts a shard for `layers` ("A..B") of `model`.
pub fn shard(exe: &Path, model: &Path, layers: &str, token: &Path, extra: &[&str]) -> Proc {
    shard_on(exe, model, layers, token, "127.0.0.1:0", extra)
}

/// Starts a shard on a given address (to restart one where it was).
pub fn shard_on(
    exe: &Path,
    model: &Path,
    layers: &str,
    token: &Path,
    listen: &str,
    extra: &[&str],
) -> Proc {
    let mut args: Vec<String> = [
        "shard",
        "--model",
        &model.display().to_string(),
        "--layers",
        layers,
        "--listen",
        listen,
        "--cluster-token-file",
        &token.display().to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(extra.iter().map(|s| s.to_string()));
    spawn(
        exe,
        &args,
        "strata shard listening on ",
        &format!("shard {layers}"),
    )
}

/// Starts a tracker over `shards`.
pub fn tracker(exe: &Path, shards: &[&Proc], token: &Path, extra: &[&str]) -> Proc {
    let list: Vec<&str> = shards.iter().map(|s| s.addr.as_str()).collect();
    let mut args: Vec<String> = [
        "tracker",
        "--shards",
        &list.join(","),
        "--listen",
        "127.0.0.1:0",
        "--cluster-token-file",
        &token.display().to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(extra.iter().map(|s| s.to_string()));
    spawn(exe, &args, "strata tracker listening on ", "tracker")
}

/// Starts a tracker over several named routes (`--route NAME=A,B` each).
pub fn tracker_routes(
    exe: &Path,
    routes: &[(&str, &[&Proc])],
    token: &Path,
    extra: &[&str],
) -> Proc {
    let mut args: Vec<String> = vec![
        "tracker".into(),
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--cluster-token-file".into(),
        token.display().to_string(),
    ];
    for (name, shards) in routes {
        let list: Vec<&str> = shards.iter().map(|s| s.addr.as_str()).collect();
        args.push("--route".into());
        args.push(format!("{name}={}", list.join(",")));
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    spawn(exe, &args, "strata tracker listening on ", "tracker")
}

/// A shard of `model` on one kernel thread, announced in the etcd at `registry` under a lease
/// of 2 s, on `listen`, with `extra` flags.
pub fn announced(
    exe: &Path,
    model: &Path,
    layers: &str,
    token: &Path,
    listen: &str,
    registry: &str,
    extra: &[&str],
) -> Proc {
    let mut args = vec![
        "--threads",
        "1",
        "--registry",
        registry,
        "--registry-ttl-s",
        "2",
    ];
    args.extend_from_slice(extra);
    shard_on(exe, model, layers, token, listen, &args)
}

/// A tracker with no route of its own, building its routes from the etcd at `registry`
/// (shards probed every 100 ms), with `extra` flags.
pub fn registry_tracker(exe: &Path, token: &Path, registry: &str, extra: &[&str]) -> Proc {
    let mut args = vec!["--registry", registry, "--health-period-ms", "100"];
    args.extend_from_slice(extra);
    tracker_routes(exe, &[], token, &args)
}

/// Starts `strata serve` on `model` with `shards` shards, one kernel thread
/// each, on a free port, with `extra` flags.
pub fn serve(exe: &Path, model: &Path, shards: &str, extra: &[&str]) -> Proc {
    let mut args: Vec<String> = [
        "serve",
        "--model",
        &model.display().to_string(),
        "--shards",
        shards,
        "--threads",
        "1",
        "--listen",
        "127.0.0.1:0",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(extra.iter().map(|s| s.to_string()));
    spawn(exe, &args, "strata tracker listening on ", "serve")
}
