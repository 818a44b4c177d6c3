//! A TCP proxy that delivers every chunk it reads a fixed delay later, in order, in both
//! directions: latency on one link of a test's cluster, where the kernel offers no `netem`
//! (`tc ... tbf` in [`crate::net`] limits bandwidth only).
//!
//! Each accepted connection gets a connection to the target and two pumps (one a direction),
//! each a reader thread stamping chunks with their due time and a writer thread sending them
//! when due, so a slow reader never delays the other direction. Dropping the proxy stops
//! accepting and closes every connection it holds.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

pub struct DelayProxy {
    /// Where clients connect (`127.0.0.1:PORT`).
    pub addr: String,
    stop: Arc<AtomicBool>,
    open: Arc<Mutex<Vec<TcpStream>>>,
    accept: Option<thread::JoinHandle<()>>,
}

impl DelayProxy {
    /// Listens on a free port of 127.0.0.1 and forwards to `target`, `delay` late each way.
    pub fn start(target: &str, delay: Duration) -> DelayProxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a free port");
        let addr = listener.local_addr().expect("bound").to_string();
        let target: SocketAddr = target.parse().expect("target is IP:PORT");
        let stop = Arc::new(AtomicBool::new(false));
        let open = Arc::new(Mutex::new(Vec::new()));
        let accept = {
            let (stop, open) = (Arc::clone(&stop), Arc::clone(&open));
            thread::spawn(move || {
                for client in listener.incoming() {
                    if stop.load(Ordering::SeqCst) {
                        return;
                    }
                    let Ok(client) = client else { continue };
                    let Ok(server) = TcpStream::connect(target) else {
                        continue;
                    };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    let mut held = open.lock().unwrap_or_else(|e| e.into_inner());
                    for s in [&client, &server] {
                        if let Ok(c) = s.try_clone() {
                            held.push(c);
                        }
                    }
                    drop(held);
                    if let (Ok(c2), Ok(s2)) = (client.try_clone(), server.try_clone()) {
                        pump(client, s2, delay);
                        pump(server, c2, delay);
                    }
                }
            })
        };
        DelayProxy {
            addr,
            stop,
            open,
            accept: Some(accept),
        }
    }
}

/// Copies `from` to `to`, each chunk `delay` after it was read; end of stream is passed on
/// (as a write shutdown) when due too.
fn pump(mut from: TcpStream, mut to: TcpStream, delay: Duration) {
    let (tx, rx) = mpsc::channel::<(Instant, Vec<u8>)>();
    thread::spawn(move || {
        let mut buf = vec![0u8; 64 << 10];
        loop {
            let n = from.read(&mut buf).unwrap_or(0);
            if tx
                .send((Instant::now() + delay, buf[..n].to_vec()))
                .is_err()
                || n == 0
            {
                return;
            }
        }
    });
    thread::spawn(move || {
        for (due, chunk) in rx {
            let now = Instant::now();
            if due > now {
                thread::sleep(due - now);
            }
            if chunk.is_empty() || to.write_all(&chunk).is_err() {
                let _ = to.shutdown(Shutdown::Write);
                return;
            }
        }
    });
}

impl Drop for DelayProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wakes the accept loop, which then sees the flag.
        let _ = TcpStream::connect(&self.addr);
        if let Some(h) = self.accept.take() {
            let _ = h.join();
        }
        for s in self
            .open
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An echo server behind the proxy: each round trip takes at least twice the delay, and
    /// what comes back is what went, in order, also for a megabyte at once.
    #[test]
    fn a_round_trip_through_the_proxy_takes_twice_its_delay_and_keeps_the_bytes() {
        let echo = TcpListener::bind("127.0.0.1:0").unwrap();
        let echo_addr = echo.local_addr().unwrap().to_string();
        thread::spawn(move || {
            for s in echo.incoming() {
                let mut s = s.unwrap();
                thread::spawn(move || {
                    let mut r = s.try_clone().unwrap();
                    let _ = std::io::copy(&mut r, &mut s);
                });
            }
        });
        let delay = Duration::from_millis(30);
        let proxy = DelayProxy::start(&echo_addr, delay);
        let mut c = TcpStream::connect(&proxy.addr).unwrap();
        for round in 0..3u8 {
            let t = Instant::now();
            c.write_all(&[round; 10]).unwrap();
            let mut got = [0u8; 10];
            c.read_exact(&mut got).unwrap();
            assert_eq!(got, [round; 10]);
            assert!(t.elapsed() >= 2 * delay, "{:?}", t.elapsed());
        }
        let big: Vec<u8> = (0..1 << 20).map(|i| (i * 31 % 251) as u8).collect();
        let mut w = c.try_clone().unwrap();
        let sent = big.clone();
        let writer = thread::spawn(move || w.write_all(&sent).unwrap());
        let mut back = vec![0u8; big.len()];
        c.read_exact(&mut back).unwrap();
        writer.join().unwrap();
        assert!(back == big, "the megabyte came back changed");
        drop(proxy);
        // The proxy closed the connection: the client reads the end.
        let mut rest = Vec::new();
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        assert_eq!(c.read_to_end(&mut rest).unwrap(), 0);
    }
}
