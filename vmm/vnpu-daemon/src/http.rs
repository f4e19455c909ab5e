//! The Prometheus endpoint's HTTP side: one resource (`GET /metrics`),
//! served with every client-controlled quantity bounded.
//!
//! It replaces `tiny_http`, which read a request head of any length whole
//! (a 512 MiB header line was taken), answered every request from one
//! thread (a client that pipelined GETs and never read its answers
//! stalled every scrape), started a thread and held two descriptors per
//! idle connection without a limit (about 500 idle connections exhausted
//! the daemon's descriptors), and whose accept loop ended on its first
//! error. Here:
//! - at most [`HttpLimits::connections`] connections are served at once;
//!   a newcomer takes the slot of one that has sent nothing for
//!   [`HttpLimits::evict_idle`] (`slots.rs`), else it is answered `503`
//!   without being read and closed;
//! - a request head is read up to [`HttpLimits::head_bytes`] (else `431`)
//!   within [`HttpLimits::deadline`] of the connection's accept, and the
//!   answer written within the same deadline, each connection on its own
//!   thread, so a slow or silent client holds only its own slot, and only
//!   that long;
//! - one request per connection (`Connection: close`);
//! - the accept loop waits out `EMFILE` and the like (`accept.rs`).

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::slots::{Slot, Slots};

/// What one client may hold of the endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HttpLimits {
    /// Connections served at once.
    pub connections: usize,
    /// Bytes of a request head (request line and headers).
    pub head_bytes: usize,
    /// From accept to the last byte of the answer.
    pub deadline: Duration,
    /// With every slot taken, a connection that has not sent its request
    /// head for this long gives its slot up to a new one.
    pub evict_idle: Duration,
}

impl Default for HttpLimits {
    fn default() -> Self {
        Self {
            connections: 16,
            head_bytes: 8 << 10,
            deadline: Duration::from_secs(5),
            evict_idle: crate::daemon::EVICT_IDLE,
        }
    }
}

/// The body of `GET /metrics` and its content type, or `None` when it
/// cannot be made now (answered `500`).
pub type Render = Arc<dyn Fn() -> Option<(String, &'static str)> + Send + Sync>;

/// A running endpoint: its accept thread and what stops it.
pub struct HttpServer {
    listener: Arc<TcpListener>,
    stopping: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl HttpServer {
    /// Serves `render` on `listener` within `limits`.
    pub fn start(listener: TcpListener, limits: HttpLimits, render: Render) -> std::io::Result<Self> {
        let listener = Arc::new(listener);
        let stopping = Arc::new(AtomicBool::new(false));
        let slots = Slots::new(limits.connections, limits.evict_idle);
        let (l, stop) = (Arc::clone(&listener), Arc::clone(&stopping));
        let thread = std::thread::Builder::new().name("metrics".into()).spawn(move || {
            while let Some((stream, _)) = crate::accept::accept_retrying("metrics", &stop, || l.accept()) {
                let accepted = Instant::now();
                let Some(slot) = slots.admit(stream.try_clone().ok().map(Into::into)) else {
                    refuse(&stream);
                    continue;
                };
                let render = Arc::clone(&render);
                let spawned = std::thread::Builder::new().name("metrics client".into()).spawn(move || {
                    serve(&stream, &slot, accepted, limits, &*render);
                });
                if spawned.is_err() {
                    // The closure, its stream and its slot are dropped.
                    log::warn!("metrics: cannot start a connection's thread");
                }
            }
        })?;
        Ok(Self { listener, stopping, thread: Some(thread) })
    }

    /// Stops accepting and joins the accept thread (connections being
    /// served end within their deadline).
    pub fn stop(&mut self) {
        self.stopping.store(true, Ordering::SeqCst);
        // SAFETY: shutdown(2) on the listening socket this value keeps
        // open (`listener`); it only makes the blocked accept() fail.
        unsafe { libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RDWR) };
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Answers `503` without reading anything, never blocking.
fn refuse(stream: &TcpStream) {
    let _ = stream.set_nonblocking(true);
    let mut s = stream;
    let _ = s.write_all(&answer(503, "text/plain", b"too many connections\n", false));
    let _ = stream.shutdown(Shutdown::Both);
}

/// Reads one request head and answers it, all within the deadline.
fn serve(
    stream: &TcpStream,
    slot: &Slot,
    accepted: Instant,
    limits: HttpLimits,
    render: &dyn Fn() -> Option<(String, &'static str)>,
) {
    let end = accepted + limits.deadline;
    let head = match read_head(stream, end, limits.head_bytes) {
        Head::Complete(h) => h,
        Head::TooLong => {
            write_by(stream, end, &answer(431, "text/plain", b"request head too long\n", false));
            return;
        }
        Head::Gone => return,
    };
    slot.busy();
    let reply = respond(&head, render);
    write_by(stream, end, &reply);
    let _ = stream.shutdown(Shutdown::Both);
}

enum Head {
    Complete(Vec<u8>),
    TooLong,
    Gone,
}

/// The bytes up to the blank line that ends a request head.
fn read_head(stream: &TcpStream, end: Instant, max: usize) -> Head {
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    let mut s = stream;
    loop {
        let Some(left) = end.checked_duration_since(Instant::now()).filter(|d| !d.is_zero()) else {
            return Head::Gone;
        };
        if s.set_read_timeout(Some(left)).is_err() {
            return Head::Gone;
        }
        let n = match s.read(&mut buf) {
            Ok(0) | Err(_) => return Head::Gone,
            Ok(n) => n,
        };
        let from = head.len().saturating_sub(3);
        head.extend_from_slice(&buf[..n]);
        if let Some(at) = head[from..].windows(4).position(|w| w == b"\r\n\r\n") {
            head.truncate(from + at);
            return Head::Complete(head);
        }
        if head.len() > max {
            return Head::TooLong;
        }
    }
}

/// Writes `bytes`, giving up at `end`.
fn write_by(stream: &TcpStream, end: Instant, bytes: &[u8]) {
    let Some(left) = end.checked_duration_since(Instant::now()).filter(|d| !d.is_zero()) else { return };
    let mut s = stream;
    if s.set_write_timeout(Some(left)).is_ok() {
        let _ = s.write_all(bytes);
    }
}

/// The answer to one request head.
fn respond(head: &[u8], render: &dyn Fn() -> Option<(String, &'static str)>) -> Vec<u8> {
    let line = head.split(|&b| b == b'\r').next().unwrap_or_default();
    let mut parts = line.split(|&b| b == b' ');
    let (method, target) = (parts.next().unwrap_or_default(), parts.next().unwrap_or_default());
    if target != b"/metrics" && !target.starts_with(b"/metrics?") {
        return answer(404, "text/plain", b"not found: the metrics are at /metrics\n", true);
    }
    let head_only = method == b"HEAD";
    if method != b"GET" && !head_only {
        return answer(405, "text/plain", b"GET /metrics\n", true);
    }
    match render() {
        Some((body, kind)) => answer(200, kind, body.as_bytes(), !head_only),
        None => answer(500, "text/plain", b"encoding failed\n", true),
    }
}

/// An HTTP/1.1 answer that closes the connection.
fn answer(status: u16, kind: &str, body: &[u8], with_body: bool) -> Vec<u8> {
    let reason = match status {
        200 => "OK",
        404 => "Not Found",
        405 => "Method Not Allowed",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        _ => "Service Unavailable",
    };
    let mut out = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    if with_body {
        out.extend_from_slice(body);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server(limits: HttpLimits) -> (HttpServer, std::net::SocketAddr) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let render: Render = Arc::new(|| Some(("x_total 1\n".to_string(), "text/plain")));
        (HttpServer::start(l, limits, render).unwrap(), addr)
    }

    fn get(addr: std::net::SocketAddr, request: &[u8]) -> String {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(request).unwrap();
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        out
    }

    #[test]
    fn routes_and_methods() {
        let (_srv, addr) = server(HttpLimits::default());
        let ok = get(addr, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n") && ok.ends_with("x_total 1\n"), "{ok}");
        assert!(ok.contains("Content-Length: 10\r\n"), "{ok}");
        let head = get(addr, b"HEAD /metrics?x=1 HTTP/1.0\r\n\r\n");
        assert!(head.starts_with("HTTP/1.1 200") && !head.contains("x_total"), "{head}");
        assert!(get(addr, b"GET / HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404"));
        assert!(get(addr, b"POST /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 405"));
        // Split across writes, headers and all.
        let mut s = TcpStream::connect(addr).unwrap();
        for part in [&b"GET /met"[..], b"rics HTTP/1.1\r\nHo", b"st: x\r\n\r", b"\n"] {
            s.write_all(part).unwrap();
            std::thread::sleep(Duration::from_millis(20));
        }
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    }

    #[test]
    fn a_long_head_is_refused_without_reading_it_all() {
        let (_srv, addr) = server(HttpLimits::default());
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nX-Big: ").unwrap();
        // Keep sending (the answer comes once 8 KiB are in, and the
        // connection closes: a write then fails).
        let chunk = vec![b'a'; 4096];
        let mut sent = 0usize;
        while sent < 64 << 20 && s.write_all(&chunk).is_ok() {
            sent += chunk.len();
        }
        assert!(sent < 64 << 20, "the server read 64 MiB of one header");
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        assert!(out.is_empty() || out.starts_with("HTTP/1.1 431"), "{out}");
    }

    /// A client that pipelines requests and never reads, and silent ones,
    /// do not hold a scrape up. (The bound is far from the timing it
    /// separates: a scrape that waited for them would take the 6 s
    /// deadline.)
    #[test]
    fn greedy_and_silent_clients_do_not_hold_a_scrape_up() {
        let limits = HttpLimits { connections: 8, deadline: Duration::from_secs(6), ..HttpLimits::default() };
        let (_srv, addr) = server(limits);
        let mut greedy = TcpStream::connect(addr).unwrap();
        greedy.write_all(&b"GET /metrics HTTP/1.1\r\n\r\n".repeat(1000)).unwrap();
        let silent: Vec<_> = (0..3).map(|_| TcpStream::connect(addr).unwrap()).collect();
        let t = Instant::now();
        assert!(get(addr, b"GET /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 200"));
        assert!(t.elapsed() < Duration::from_secs(3), "a scrape waited {:?}", t.elapsed());
        drop((greedy, silent));
    }

    /// With every slot held by a silent client, the next is told so at
    /// once while they are fresh; once they have been idle for
    /// `evict_idle` a newcomer takes the slot of the one idle longest
    /// (well before their 6 s deadline), and that one is closed.
    #[test]
    fn silent_clients_give_their_slots_up_to_newcomers() {
        let limits = HttpLimits {
            connections: 4,
            deadline: Duration::from_secs(6),
            evict_idle: Duration::from_millis(500),
            ..HttpLimits::default()
        };
        let (_srv, addr) = server(limits);
        let mut silent: Vec<_> = (0..4).map(|_| TcpStream::connect(addr).unwrap()).collect();
        let t = Instant::now();
        let refused = get(addr, b"GET /metrics HTTP/1.1\r\n\r\n");
        if t.elapsed() < Duration::from_millis(400) {
            assert!(refused.starts_with("HTTP/1.1 503"), "{refused}");
        }
        std::thread::sleep(Duration::from_millis(600));
        let t = Instant::now();
        let served = get(addr, b"GET /metrics HTTP/1.1\r\n\r\n");
        assert!(served.starts_with("HTTP/1.1 200"), "{served}");
        assert!(t.elapsed() < Duration::from_secs(3), "the newcomer waited {:?}", t.elapsed());
        // The oldest silent connection was closed for it.
        silent[0].set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut b = [0u8; 1];
        assert!(matches!(silent[0].read(&mut b), Ok(0) | Err(_)), "the evicted connection is still open");
    }
}
