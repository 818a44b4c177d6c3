//! "Hosts" for tests: Linux network namespaces, each with its own network stack and address on a
//! private bridge (`10.77.N.i/24`; the test process itself is `10.77.N.254` on the bridge), made
//! by the test and removed when the [`Net`] drops. Processes started on a host bind and connect
//! through its stack only, so a swarm spread over hosts talks over real interfaces instead of one
//! loopback; a host's link can be limited in bandwidth (`tc ... tbf`, both directions).
//!
//! Making namespaces needs root (CAP_NET_ADMIN) and the `ip` and `tc` tools; [`Net::new`]
//! says why it cannot when they are missing, so a test can say so plainly and stop.

use std::path::Path;
use std::process::{Command, Output, Stdio};

use crate::procs::{spawn_command, Proc};

/// A private network of hosts: one bridge and the namespaces plugged into it.
pub struct Net {
    /// The third byte of every address, and the number in every interface name.
    n: u8,
    hosts: Vec<Host>,
}

/// One host: a network namespace plugged into the net's bridge.
#[derive(Clone, Debug)]
pub struct Host {
    /// The namespace's name (`ip netns`).
    pub ns: String,
    /// Its address on the bridge.
    pub ip: String,
    /// Its end of the link in the root namespace (on the bridge) and inside its namespace.
    outer: String,
    inner: String,
}

fn run(args: &[&str]) -> Result<Output, String> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("{}: {e}", args[0]))?;
    if out.status.success() {
        Ok(out)
    } else {
        Err(format!(
            "`{}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl Net {
    /// A new bridge with no hosts yet, or why this machine cannot make one (not root, no `ip`).
    pub fn new() -> Result<Net, String> {
        // The effective user id, the second field of `Uid:`.
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let euid = status
            .lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|ids| ids.split_whitespace().nth(1).map(str::to_string));
        if euid.as_deref() != Some("0") {
            return Err("network namespaces need root".into());
        }
        run(&["ip", "-V"]).map_err(|e| format!("no `ip` tool: {e}"))?;
        // The bridge's name is the lock on its number: the first free one, from one that
        // differs between test processes so that concurrent tests rarely try the same.
        let start = (std::process::id() % 250) as u8;
        for i in 0..250u16 {
            let n = ((start as u16 + i) % 250) as u8 + 1;
            let bridge = format!("stb{n}");
            if run(&["ip", "link", "add", &bridge, "type", "bridge"]).is_err() {
                continue;
            }
            let net = Net {
                n,
                hosts: Vec::new(),
            };
            run(&[
                "ip",
                "addr",
                "add",
                &format!("10.77.{n}.254/24"),
                "dev",
                &bridge,
            ])?;
            run(&["ip", "link", "set", &bridge, "up"])?;
            return Ok(net);
        }
        Err("no free bridge number (stb1..stb250 all exist)".into())
    }

    /// The address the test process has on the bridge.
    pub fn own_ip(&self) -> String {
        format!("10.77.{}.254", self.n)
    }

    /// A new host plugged into the bridge, with its loopback up.
    pub fn host(&mut self) -> Result<Host, String> {
        let (n, i) = (self.n, self.hosts.len() + 1);
        assert!(i < 254, "at most 253 hosts");
        let host = Host {
            ns: format!("strata-{n}-{i}"),
            ip: format!("10.77.{n}.{i}"),
            outer: format!("st{n}v{i}"),
            inner: format!("st{n}p{i}"),
        };
        run(&["ip", "netns", "add", &host.ns])?;
        // Registered at once, so that a failure below still removes the namespace.
        self.hosts.push(host.clone());
        run(&[
            "ip",
            "link",
            "add",
            &host.outer,
            "type",
            "veth",
            "peer",
            "name",
            &host.inner,
        ])?;
        run(&["ip", "link", "set", &host.inner, "netns", &host.ns])?;
        run(&[
            "ip",
            "link",
            "set",
            &host.outer,
            "master",
            &format!("stb{n}"),
            "up",
        ])?;
        host.exec(&[
            "ip",
            "addr",
            "add",
            &format!("{}/24", host.ip),
            "dev",
            &host.inner,
        ])?;
        host.exec(&["ip", "link", "set", &host.inner, "up"])?;
        host.exec(&["ip", "link", "set", "lo", "up"])?;
        Ok(host)
    }

    /// Limits `host`'s link to `mbit` megabits per second each way (a token bucket on both
    /// ends of its link).
    pub fn limit(&self, host: &Host, mbit: u32) -> Result<(), String> {
        let rate = format!("{mbit}mbit");
        let tbf = |dev: &str| -> Vec<String> {
            [
                "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", &rate,
            ]
            .iter()
            .map(|s| s.to_string())
            .chain(["burst", "64kb", "latency", "200ms"].map(String::from))
            .collect()
        };
        let outer = tbf(&host.outer);
        run(&outer.iter().map(String::as_str).collect::<Vec<_>>())?;
        let inner = tbf(&host.inner);
        host.exec(&inner.iter().map(String::as_str).collect::<Vec<_>>())?;
        Ok(())
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        // Deleting a namespace kills nothing: the processes started in it are the test's
        // handles, dropped before the net (declare the net first). Its veth pair goes with it.
        for host in &self.hosts {
            let _ = run(&["ip", "netns", "del", &host.ns]);
            let _ = run(&["ip", "link", "del", &host.outer]);
        }
        let _ = run(&["ip", "link", "del", &format!("stb{}", self.n)]);
    }
}

impl Host {
    /// Runs a command inside this host's namespace to completion.
    pub fn exec(&self, args: &[&str]) -> Result<Output, String> {
        let mut all = vec!["ip", "netns", "exec", &self.ns];
        all.extend_from_slice(args);
        run(&all)
    }

    /// `exe args...` to be started inside this host's namespace (`ip netns exec` execs it, so
    /// the child's pid is the program's).
    pub fn command(&self, exe: &Path) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.ns]).arg(exe);
        cmd
    }

    /// Starts `exe args...` on this host and waits until it prints a line starting with
    /// `ready_prefix` (as [`crate::procs::spawn`]).
    pub fn spawn(&self, exe: &Path, args: &[String], ready_prefix: &str, name: &str) -> Proc {
        let mut cmd = self.command(exe);
        cmd.args(args);
        spawn_command(cmd, ready_prefix, &format!("{name} on {}", self.ip))
    }
}
