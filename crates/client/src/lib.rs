//! A tiny HTTP/1.1 client over `std::net::TcpStream` for `strata bench` and the tests: JSON
//! requests, chunked and fixed-length bodies, and incremental server-sent events (dropping the
//! reader disconnects). Loopback use only; no TLS, no keep-alive.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// A complete response.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Response {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

fn connect(addr: &str) -> std::io::Result<TcpStream> {
    let s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(120)))?;
    s.set_nodelay(true)?;
    Ok(s)
}

fn send(
    stream: &mut TcpStream,
    method: &str,
    addr: &str,
    path: &str,
    body: Option<&str>,
    extra: &[(&str, &str)],
) -> std::io::Result<()> {
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in extra {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some(b) = body {
        req.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            b.len()
        ));
    }
    req.push_str("\r\n");
    if let Some(b) = body {
        req.push_str(b);
    }
    stream.write_all(req.as_bytes())
}

fn read_head(r: &mut BufReader<TcpStream>) -> std::io::Result<(u16, Vec<(String, String)>)> {
    let mut line = String::new();
    r.read_line(&mut line)?;
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("bad status line {line:?}")))?;
    let mut headers = Vec::new();
    loop {
        let mut h = String::new();
        r.read_line(&mut h)?;
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.push((k.trim().to_string(), v.trim().to_string()));
        }
    }
    Ok((status, headers))
}

fn is_chunked(headers: &[(String, String)]) -> bool {
    headers.iter().any(|(k, v)| {
        k.eq_ignore_ascii_case("transfer-encoding") && v.eq_ignore_ascii_case("chunked")
    })
}

/// Reads one chunk of a chunked body; `None` at the end.
fn read_chunk(r: &mut BufReader<TcpStream>) -> std::io::Result<Option<Vec<u8>>> {
    let mut size = String::new();
    if r.read_line(&mut size)? == 0 {
        return Ok(None);
    }
    let n = usize::from_str_radix(size.trim().split(';').next().unwrap_or("0"), 16)
        .map_err(std::io::Error::other)?;
    if n == 0 {
        return Ok(None);
    }
    let mut buf = vec![0u8; n + 2];
    r.read_exact(&mut buf)?;
    buf.truncate(n);
    Ok(Some(buf))
}

/// Sends a request and reads the whole response.
pub fn request(
    method: &str,
    addr: &str,
    path: &str,
    body: Option<&serde_json::Value>,
    headers: &[(&str, &str)],
) -> std::io::Result<Response> {
    let mut s = connect(addr)?;
    let body = body.map(|b| b.to_string());
    // A server may answer before it has read the whole body (a 413) and close: the write then
    // fails, but the answer may still be there to read, as curl reads it.
    let early_close = match send(&mut s, method, addr, path, body.as_deref(), headers) {
        Ok(()) => None,
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
            ) =>
        {
            Some(e)
        }
        Err(e) => return Err(e),
    };
    let mut r = BufReader::new(s);
    let (status, headers) = match read_head(&mut r) {
        Ok(head) => head,
        Err(e) => return Err(early_close.unwrap_or(e)),
    };
    let mut bytes = Vec::new();
    if is_chunked(&headers) {
        while let Some(c) = read_chunk(&mut r)? {
            bytes.extend(c);
        }
    } else {
        r.read_to_end(&mut bytes)?;
    }
    Ok(Response {
        status,
        headers,
        body: String::from_utf8_lossy(&bytes).into_owned(),
    })
}

pub fn post_json(addr: &str, path: &str, body: &serde_json::Value) -> Response {
    request("POST", addr, path, Some(body), &[])
        .unwrap_or_else(|e| panic!("POST {path} to {addr}: {e}"))
}

pub fn get(addr: &str, path: &str) -> Response {
    request("GET", addr, path, None, &[]).unwrap_or_else(|e| panic!("GET {path} from {addr}: {e}"))
}

/// A streaming response read event by event. Dropping it closes the connection.
pub struct SseStream {
    pub status: u16,
    reader: BufReader<TcpStream>,
    chunked: bool,
    buf: String,
}

impl SseStream {
    /// Opens a streaming POST.
    pub fn open(addr: &str, path: &str, body: &serde_json::Value) -> std::io::Result<SseStream> {
        SseStream::open_with(addr, path, body, &[])
    }

    /// Opens a streaming POST with extra headers.
    pub fn open_with(
        addr: &str,
        path: &str,
        body: &serde_json::Value,
        headers: &[(&str, &str)],
    ) -> std::io::Result<SseStream> {
        let mut s = connect(addr)?;
        send(&mut s, "POST", addr, path, Some(&body.to_string()), headers)?;
        let mut reader = BufReader::new(s);
        let (status, headers) = read_head(&mut reader)?;
        Ok(SseStream {
            status,
            chunked: is_chunked(&headers),
            reader,
            buf: String::new(),
        })
    }

    /// The next event's `data` payload, or `None` at the end of the stream.
    pub fn next_data(&mut self) -> Option<String> {
        loop {
            if let Some(end) = self.buf.find("\n\n") {
                let event: String = self.buf.drain(..end + 2).collect();
                let data: Vec<&str> = event
                    .lines()
                    .filter_map(|l| l.strip_prefix("data:"))
                    .map(|d| d.trim_start())
                    .collect();
                if data.is_empty() {
                    continue; // keep-alive comment
                }
                return Some(data.join("\n"));
            }
            let more = if self.chunked {
                read_chunk(&mut self.reader).ok().flatten()
            } else {
                let mut b = vec![0u8; 4096];
                match self.reader.read(&mut b) {
                    Ok(0) | Err(_) => None,
                    Ok(n) => {
                        b.truncate(n);
                        Some(b)
                    }
                }
            };
            self.buf.push_str(&String::from_utf8_lossy(&more?));
        }
    }
}

/// The token ids a streamed request's first choice received (`return_token_ids`), read to
/// `[DONE]`; an error event, an unparsable event or a stream cut before `[DONE]` is an error
/// naming it.
pub fn stream_token_ids(
    addr: &str,
    path: &str,
    body: &serde_json::Value,
) -> Result<Vec<u64>, String> {
    let mut s = SseStream::open(addr, path, body).map_err(|e| e.to_string())?;
    let mut ids = Vec::new();
    while let Some(d) = s.next_data() {
        if d == "[DONE]" {
            return Ok(ids);
        }
        let v: serde_json::Value = serde_json::from_str(&d).map_err(|e| format!("{e}: {d}"))?;
        if v.get("error").is_some() {
            return Err(d);
        }
        if let Some(t) = v["choices"][0]["token_ids"].as_array() {
            ids.extend(t.iter().filter_map(serde_json::Value::as_u64));
        }
    }
    Err("the stream ended without [DONE]".into())
}
