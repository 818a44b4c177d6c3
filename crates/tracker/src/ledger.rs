//! The usage ledger: API keys with token budgets, and one row per accepted request, in SQLite
//! (WAL journal, `synchronous = FULL`).
//!
//! A request's row is committed as `accepted`, with its reservation (prompt plus `max_tokens`),
//! before it is submitted, so no accepted request can be lost. While it runs, the tokens it has
//! generated are checkpointed into its row (the writer commits every request's progress in one
//! transaction at most every [`CHECKPOINT_EVERY`]). Billing policy for a request cut off by a
//! crash of the tracker (kill -9 included): the next start marks the rows it finds still
//! `accepted` as `interrupted` and charges each its prompt plus the tokens last checkpointed,
//! what was generated for it up to one checkpoint interval before the crash (never its whole
//! reservation: what it did not generate is not billed). Finished requests are settled with
//! what they really used, off the scheduling loop by the same writer thread. A key's usage is
//! the sum of its charges plus the reservations of its requests in flight, so concurrent
//! requests can never overspend a budget.

use std::path::Path;
use std::sync::{mpsc, Arc, Mutex};

use rusqlite::{params, Connection};

use engine::Refusal;

/// One API key: a name (used in the ledger and in messages; the secret never is) and a budget.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiKey {
    pub name: String,
    pub secret: String,
    pub budget_tokens: u64,
}

/// Parses an API keys file: one key per line, `NAME SECRET BUDGET_TOKENS`; `#` starts a
/// comment.
pub fn parse_keys(text: &str) -> Result<Vec<ApiKey>, String> {
    let mut keys = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let f: Vec<&str> = line.split_whitespace().collect();
        let [name, secret, budget] = f[..] else {
            return Err(format!(
                "line {}: expected `NAME SECRET BUDGET_TOKENS`, got {} fields",
                n + 1,
                f.len()
            ));
        };
        let budget_tokens = budget
            .parse()
            .map_err(|_| format!("line {}: budget `{budget}` is not a token count", n + 1))?;
        if keys
            .iter()
            .any(|k: &ApiKey| k.name == name || k.secret == secret)
        {
            return Err(format!("line {}: key `{name}` is given twice", n + 1));
        }
        keys.push(ApiKey {
            name: name.into(),
            secret: secret.into(),
            budget_tokens,
        });
    }
    Ok(keys)
}

/// A key's standing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Usage {
    pub key: String,
    pub budget_tokens: u64,
    /// Charged tokens of settled requests.
    pub charged_tokens: u64,
    /// Reservations of requests in flight.
    pub reserved_tokens: u64,
    /// Rows by status.
    pub requests: Vec<(String, u64)>,
}

enum Write {
    Settle {
        row: i64,
        prompt: u64,
        completion: u64,
        status: &'static str,
    },
    /// `completion` tokens generated so far (a checkpoint; the latest one per row counts).
    Progress {
        row: i64,
        completion: u64,
    },
    Flush(mpsc::Sender<()>),
}

/// How often the progress of requests in flight is committed.
pub const CHECKPOINT_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

pub struct Ledger {
    conn: Arc<Mutex<Connection>>,
    keys: Vec<ApiKey>,
    writes: Mutex<mpsc::Sender<Write>>,
    /// Rows found `accepted` at start (a previous run died) and marked `interrupted`.
    pub interrupted_at_start: u64,
}

impl std::fmt::Debug for Ledger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Ledger({} keys)", self.keys.len())
    }
}

fn db_err(e: rusqlite::Error) -> String {
    format!("usage ledger: {e}")
}

impl Ledger {
    /// Opens (or creates) the ledger at `path` with these keys and budgets.
    pub fn open(path: &Path, keys: Vec<ApiKey>) -> Result<Ledger, String> {
        let conn = Connection::open(path).map_err(db_err)?;
        conn.execute_batch(
            "PRAGMA journal_mode = WAL;
             PRAGMA synchronous = FULL;
             CREATE TABLE IF NOT EXISTS requests (
                 id INTEGER PRIMARY KEY AUTOINCREMENT,
                 key TEXT NOT NULL,
                 prompt_tokens INTEGER NOT NULL,
                 max_tokens INTEGER NOT NULL,
                 completion_tokens INTEGER NOT NULL DEFAULT 0,
                 charged_tokens INTEGER NOT NULL DEFAULT 0,
                 status TEXT NOT NULL,
                 accepted_at_ms INTEGER NOT NULL,
                 settled_at_ms INTEGER
             );
             CREATE INDEX IF NOT EXISTS requests_key ON requests (key, status);",
        )
        .map_err(db_err)?;
        conn.busy_timeout(std::time::Duration::from_secs(5))
            .map_err(db_err)?;
        let interrupted = conn
            .execute(
                "UPDATE requests SET status = 'interrupted',
                     charged_tokens = prompt_tokens + MIN(completion_tokens, max_tokens),
                     settled_at_ms = ?1
                 WHERE status = 'accepted'",
                params![now_ms()],
            )
            .map_err(db_err)? as u64;
        if interrupted > 0 {
            tracing::warn!(
                interrupted,
                "the usage ledger held requests of a run that ended without settling them; each is charged its prompt and the tokens last checkpointed"
            );
        }
        let conn = Arc::new(Mutex::new(conn));
        let (tx, rx) = mpsc::channel::<Write>();
        let writer = Arc::clone(&conn);
        std::thread::Builder::new()
            .name("strata-ledger".into())
            .spawn(move || write_loop(&writer, &rx))
            .map_err(|e| format!("starting the ledger writer: {e}"))?;
        Ok(Ledger {
            conn,
            keys,
            writes: Mutex::new(tx),
            interrupted_at_start: interrupted,
        })
    }

    /// The key a bearer secret names. Without configured keys every request is `anonymous`
    /// with no budget (its usage is still recorded); with keys, an unknown secret is refused.
    pub fn authenticate(&self, secret: &str) -> Result<ApiKey, Refusal> {
        if self.keys.is_empty() {
            return Ok(ApiKey {
                name: "anonymous".into(),
                secret: String::new(),
                budget_tokens: u64::MAX,
            });
        }
        self.keys
            .iter()
            .find(|k| proto::secrets_equal(secret, &k.secret))
            .cloned()
            .ok_or_else(Refusal::unauthorized)
    }

    /// How many API keys are configured.
    pub fn n_keys(&self) -> usize {
        self.keys.len()
    }

    /// Whether API keys are configured (then every request must name one).
    pub fn has_keys(&self) -> bool {
        !self.keys.is_empty()
    }

    /// Commits an `accepted` row reserving `prompt + max_tokens` tokens for `key`, or refuses
    /// with `budget` when that would overspend its budget. Blocking (a durable commit).
    pub fn reserve(&self, key: &ApiKey, prompt: u64, max_tokens: u64) -> Result<i64, Refusal> {
        let mut c = self.conn.lock().unwrap_or_else(|e| e.into_inner());
        let tx = c
            .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
            .map_err(|e| Refusal::unavailable(db_err(e)))?;
        let (charged, reserved) =
            totals(&tx, &key.name).map_err(|e| Refusal::unavailable(db_err(e)))?;
        let need = prompt + max_tokens;
        let left = key.budget_tokens.saturating_sub(charged + reserved);
        if need > left {
            return Err(Refusal::budget(
                &format!("token_budget[{}]", key.name),
                format!(
                    "token_budget[{}]: this request may use {need} tokens (prompt {prompt} + max_tokens {max_tokens}), {left} of {} are left ({charged} used, {reserved} reserved by requests in flight)",
                    key.name, key.budget_tokens
                ),
            ));
        }
        tx.execute(
            "INSERT INTO requests (key, prompt_tokens, max_tokens, status, accepted_at_ms)
             VALUES (?1, ?2, ?3, 'accepted', ?4)",
            params![key.name, prompt as i64, max_tokens as i64, now_ms()],
        )
        .map_err(|e| Refusal::unavailable(db_err(e)))?;
        let row = tx.last_insert_rowid();
        tx.commit().map_err(|e| Refusal::unavailable(db_err(e)))?;
        Ok(row)
    }

    /// Records what a request used (`done`, `cancelled`, `failed`), or that it was `refused`
    /// after its reservation (charged nothing). Does not block: a writer thread commits it.
    pub fn settle(&self, row: i64, prompt: u64, completion: u64, status: &'static str) {
        let w = Write::Settle {
            row,
            prompt,
            completion,
            status,
        };
        let _ = self
            .writes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send(w);
    }

    /// Notes that the request of `row` has generated `completion` tokens so far; the writer
    /// commits the latest count within [`CHECKPOINT_EVERY`]. What a crash would bill.
    pub fn progress(&self, row: i64, completion: u64) {
        let w = Write::Progress { row, completion };
        let _ = self
            .writes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send(w);
    }

    /// Waits until every settle and checkpoint sent so far is committed.
    pub fn flush(&self) {
        let (tx, rx) = mpsc::channel();
        let sent = self
            .writes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send(Write::Flush(tx));
        if sent.is_ok() {
            let _ = rx.recv();
        }
    }

    /// A key's standing (settled writes first).
    pub fn usage(&self, key: &ApiKey) -> Result<Usage, String> {
        self.flush();
        let c = self.conn.lock().unwrap_or_else(|e| e.into_inner());
        let (charged, reserved) = totals(&c, &key.name).map_err(db_err)?;
        let mut stmt = c
            .prepare("SELECT status, COUNT(*) FROM requests WHERE key = ?1 GROUP BY status ORDER BY status")
            .map_err(db_err)?;
        let requests = stmt
            .query_map(params![key.name], |r| {
                Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)? as u64))
            })
            .map_err(db_err)?
            .collect::<Result<Vec<_>, _>>()
            .map_err(db_err)?;
        Ok(Usage {
            key: key.name.clone(),
            budget_tokens: key.budget_tokens,
            charged_tokens: charged,
            reserved_tokens: reserved,
            requests,
        })
    }
}

/// The writer thread: settles rows as they come, and commits the progress checkpoints
/// gathered meanwhile at most every [`CHECKPOINT_EVERY`] (one transaction for them all).
fn write_loop(conn: &Mutex<Connection>, rx: &mpsc::Receiver<Write>) {
    let mut progress: std::collections::HashMap<i64, u64> = std::collections::HashMap::new();
    let mut last_checkpoint = std::time::Instant::now();
    loop {
        let w = match rx.recv_timeout(CHECKPOINT_EVERY) {
            Ok(w) => Some(w),
            Err(mpsc::RecvTimeoutError::Timeout) => None,
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                checkpoint(conn, &mut progress);
                return;
            }
        };
        match w {
            Some(Write::Progress { row, completion }) => {
                progress.insert(row, completion);
            }
            Some(Write::Settle {
                row,
                prompt,
                completion,
                status,
            }) => {
                progress.remove(&row);
                let c = conn.lock().unwrap_or_else(|e| e.into_inner());
                let charged = if status == "refused" {
                    0
                } else {
                    prompt + completion
                };
                if let Err(e) = c.execute(
                    "UPDATE requests SET status = ?1, completion_tokens = ?2,
                         charged_tokens = ?3, settled_at_ms = ?4
                     WHERE id = ?5 AND status = 'accepted'",
                    params![status, completion as i64, charged as i64, now_ms(), row],
                ) {
                    tracing::error!(error = %e, row, "settling a ledger row failed");
                }
            }
            Some(Write::Flush(done)) => {
                checkpoint(conn, &mut progress);
                let _ = done.send(());
            }
            None => {}
        }
        if last_checkpoint.elapsed() >= CHECKPOINT_EVERY {
            checkpoint(conn, &mut progress);
            last_checkpoint = std::time::Instant::now();
        }
    }
}

/// Commits every gathered progress checkpoint of rows still in flight, in one transaction.
fn checkpoint(conn: &Mutex<Connection>, progress: &mut std::collections::HashMap<i64, u64>) {
    if progress.is_empty() {
        return;
    }
    let mut c = conn.lock().unwrap_or_else(|e| e.into_inner());
    let result = (|| {
        let tx = c.transaction()?;
        for (row, completion) in progress.drain() {
            tx.execute(
                "UPDATE requests SET completion_tokens = ?1 WHERE id = ?2 AND status = 'accepted'",
                params![completion as i64, row],
            )?;
        }
        tx.commit()
    })();
    if let Err(e) = result {
        tracing::error!(error = %e, "checkpointing ledger progress failed");
    }
}

/// (charged by settled rows, reserved by rows in flight) for one key. An aggregate always
/// returns one row (zeros for a key with none).
fn totals(c: &Connection, key: &str) -> rusqlite::Result<(u64, u64)> {
    c.query_row(
        "SELECT
             COALESCE(SUM(CASE WHEN status = 'accepted' THEN 0 ELSE charged_tokens END), 0),
             COALESCE(SUM(CASE WHEN status = 'accepted' THEN prompt_tokens + max_tokens ELSE 0 END), 0)
         FROM requests WHERE key = ?1",
        params![key],
        |r| Ok((r.get::<_, i64>(0)? as u64, r.get::<_, i64>(1)? as u64)),
    )
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(name: &str, budget: u64) -> ApiKey {
        ApiKey {
            name: name.into(),
            secret: format!("secret-{name}"),
            budget_tokens: budget,
        }
    }

    fn temp_db(name: &str) -> std::path::PathBuf {
        let p = std::env::temp_dir().join(format!(
            "strata-ledger-{name}-{}.sqlite",
            std::process::id()
        ));
        for ext in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{ext}", p.display()));
        }
        p
    }

    #[test]
    fn reservations_and_charges_never_overspend_and_survive_reopening() {
        let path = temp_db("unit");
        let k = key("alice", 100);
        let l = Ledger::open(&path, vec![k.clone()]).unwrap();
        let a = l.reserve(&k, 10, 40).unwrap();
        let b = l.reserve(&k, 10, 40).unwrap();
        let e = l.reserve(&k, 10, 1).unwrap_err();
        assert_eq!(e.reason, engine::Reason::Budget);
        assert_eq!(e.limit.as_deref(), Some("token_budget[alice]"));
        l.settle(a, 10, 5, "done");
        let u = l.usage(&k).unwrap();
        assert_eq!((u.charged_tokens, u.reserved_tokens), (15, 50));
        // `b` is in flight when the process "dies", 7 tokens into its answer: reopening
        // charges its prompt and what it generated, not its reservation.
        l.progress(b, 7);
        l.flush();
        drop(l);
        let l = Ledger::open(&path, vec![k.clone()]).unwrap();
        assert_eq!(l.interrupted_at_start, 1);
        let u = l.usage(&k).unwrap();
        assert_eq!((u.charged_tokens, u.reserved_tokens), (32, 0));
        assert_eq!(
            u.requests,
            vec![("done".to_string(), 1), ("interrupted".to_string(), 1)]
        );
        assert!(l.reserve(&k, 10, 58).is_ok());
        assert!(
            l.reserve(&k, 1, 0).is_err(),
            "100 of 100 are spent or reserved"
        );
    }

    #[test]
    fn a_keys_file_is_parsed_and_bad_lines_are_named() {
        let keys = parse_keys("# name secret budget\nalice s1 100\n\nbob s2 5 # small\n").unwrap();
        assert_eq!(keys.len(), 2);
        assert_eq!(
            keys[1],
            ApiKey {
                name: "bob".into(),
                secret: "s2".into(),
                budget_tokens: 5
            }
        );
        assert!(parse_keys("alice s1").unwrap_err().starts_with("line 1"));
        assert!(parse_keys("a s 1\nb s 2").unwrap_err().contains("twice"));
        assert!(parse_keys("a s lots")
            .unwrap_err()
            .contains("not a token count"));
    }
}
