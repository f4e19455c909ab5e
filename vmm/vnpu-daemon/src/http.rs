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
//! - one thread accepts connections and reads their request heads, all
//!   non-blocking, in one `poll(2)` loop: a connection that has not sent
//!   its head costs a descriptor and a buffer, no thread. At most
//!   [`HttpLimits::pending`] wait for their heads; a newcomer beyond that
//!   closes the one waiting longest (an honest client sends its head as
//!   soon as it connects, so a crowd of silent or churned connections
//!   cannot keep a scrape out: the scrape's head arrives before the crowd
//!   has pushed it out), and each is closed at [`HttpLimits::deadline`];
//! - a head is read up to [`HttpLimits::head_bytes`] (else `431`);
//! - at most [`HttpLimits::connections`] complete requests are answered
//!   at once, each on its own thread, the answer written within the
//!   deadline; a request beyond that is answered `503` at once;
//! - one request per connection (`Connection: close`);
//! - a failed accept (`EMFILE` and the like) is waited out, and a stop
//!   ends the loop within [`TICK`].

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What one client may hold of the endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HttpLimits {
    /// Requests answered at once.
    pub connections: usize,
    /// Connections waiting for their request heads.
    pub pending: usize,
    /// Bytes of a request head (request line and headers).
    pub head_bytes: usize,
    /// From accept to the last byte of the answer.
    pub deadline: Duration,
}

impl Default for HttpLimits {
    fn default() -> Self {
        Self { connections: 16, pending: 256, head_bytes: 8 << 10, deadline: Duration::from_secs(5) }
    }
}

/// The longest the loop sleeps: how soon it sees a stop (and retries a
/// failed accept).
pub const TICK: Duration = Duration::from_millis(50);

/// The body of `GET /metrics` and its content type, or `None` when it
/// cannot be made now (answered `500`).
pub type Render = Arc<dyn Fn() -> Option<(String, &'static str)> + Send + Sync>;

/// A running endpoint: its thread and what stops it.
pub struct HttpServer {
    stopping: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl HttpServer {
    /// Serves `render` on `listener` within `limits`.
    pub fn start(listener: TcpListener, limits: HttpLimits, render: Render) -> std::io::Result<Self> {
        listener.set_nonblocking(true)?;
        let stopping = Arc::new(AtomicBool::new(false));
        let stop = Arc::clone(&stopping);
        let thread = std::thread::Builder::new()
            .name("metrics".into())
            .spawn(move || Endpoint::new(listener, limits, render).run(&stop))?;
        Ok(Self { stopping, thread: Some(thread) })
    }

    /// Stops accepting and joins the endpoint's thread (requests being
    /// answered end within their deadline).
    pub fn stop(&mut self) {
        self.stopping.store(true, Ordering::SeqCst);
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

/// A connection waiting for its request head.
struct Pending {
    stream: TcpStream,
    accepted: Instant,
    head: Vec<u8>,
}

/// What a read of a pending connection found.
enum HeadRead {
    /// Keep waiting.
    More,
    /// The head is complete (without its blank line).
    Head(Vec<u8>),
    TooLong,
    Gone,
}

/// The endpoint's loop state.
struct Endpoint {
    listener: TcpListener,
    limits: HttpLimits,
    render: Render,
    pending: VecDeque<Pending>,
    /// Requests being answered.
    busy: Arc<AtomicUsize>,
    /// Accept failed (descriptors exhausted): not tried again before this.
    accept_after: Option<Instant>,
}

impl Endpoint {
    fn new(listener: TcpListener, limits: HttpLimits, render: Render) -> Self {
        Self {
            listener,
            limits,
            render,
            pending: VecDeque::new(),
            busy: Arc::new(AtomicUsize::new(0)),
            accept_after: None,
        }
    }

    fn run(&mut self, stop: &AtomicBool) {
        let mut fds: Vec<libc::pollfd> = Vec::new();
        while !stop.load(Ordering::SeqCst) {
            let now = Instant::now();
            self.pending.retain(|p| now < p.accepted + self.limits.deadline);
            let accepting = self.accept_after.is_none_or(|t| now >= t);
            fds.clear();
            fds.push(libc::pollfd {
                fd: if accepting { self.listener.as_raw_fd() } else { -1 },
                events: libc::POLLIN,
                revents: 0,
            });
            fds.extend(self.pending.iter().map(|p| libc::pollfd {
                fd: p.stream.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            }));
            let n = libc::nfds_t::try_from(fds.len()).unwrap_or(libc::nfds_t::MAX);
            let tick = libc::c_int::try_from(TICK.as_millis()).unwrap_or(50);
            // SAFETY: poll(2) on `fds`, a vector of `n` pollfds this loop
            // owns for the whole call; it only writes their `revents`.
            let r = unsafe { libc::poll(fds.as_mut_ptr(), n, tick) };
            if r <= 0 {
                continue;
            }
            // Heads first (a newcomer may push the oldest out below); the
            // pollfds after the listener's are `pending`'s, in order.
            let mut done = Vec::new();
            for (i, f) in fds[1..].iter().enumerate() {
                if f.revents == 0 {
                    continue;
                }
                let Some(p) = self.pending.get_mut(i) else { break };
                match read_some(p, self.limits.head_bytes) {
                    HeadRead::More => {}
                    outcome => done.push((i, outcome)),
                }
            }
            // From the back, so that each index still names its connection.
            for (i, outcome) in done.into_iter().rev() {
                if let Some(p) = self.pending.remove(i) {
                    self.finish(p, outcome);
                }
            }
            if fds[0].revents != 0 {
                self.accept_all();
            }
        }
    }

    /// Takes every waiting connection (`pending` at most: the longest
    /// waiting ones make room).
    fn accept_all(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((stream, _)) => {
                    if stream.set_nonblocking(true).is_err() {
                        continue;
                    }
                    if self.pending.len() >= self.limits.pending.max(1) {
                        self.make_room();
                    }
                    self.pending.push_back(Pending { stream, accepted: Instant::now(), head: Vec::new() });
                    self.accept_after = None;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    // Descriptors exhausted and the like: the oldest
                    // waiting connection goes, and accepting waits a tick.
                    if self.accept_after.is_none() {
                        log::warn!("metrics: accept failed ({e}); retrying every {} ms", TICK.as_millis());
                    }
                    self.make_room();
                    self.accept_after = Some(Instant::now() + TICK);
                    return;
                }
            }
        }
    }

    /// Takes the connection waiting longest out of `pending`: answered
    /// if its head has arrived since the last look (a burst of newcomers
    /// between two looks must not push out a client that did send its
    /// request), else closed.
    fn make_room(&mut self) {
        let Some(mut old) = self.pending.pop_front() else { return };
        match read_some(&mut old, self.limits.head_bytes) {
            HeadRead::More | HeadRead::Gone => {
                let _ = old.stream.shutdown(Shutdown::Both);
            }
            outcome => self.finish(old, outcome),
        }
    }

    /// Answers a connection whose head is complete (or refuses it).
    fn finish(&mut self, p: Pending, outcome: HeadRead) {
        let end = p.accepted + self.limits.deadline;
        let head = match outcome {
            HeadRead::Head(h) => h,
            HeadRead::TooLong => {
                write_now(&p.stream, &answer(431, "text/plain", b"request head too long\n", false));
                return;
            }
            HeadRead::Gone | HeadRead::More => return,
        };
        if self.busy.fetch_add(1, Ordering::SeqCst) >= self.limits.connections {
            self.busy.fetch_sub(1, Ordering::SeqCst);
            write_now(&p.stream, &answer(503, "text/plain", b"too many requests at once\n", false));
            return;
        }
        let (render, busy) = (Arc::clone(&self.render), Arc::clone(&self.busy));
        let spawned = std::thread::Builder::new().name("metrics client".into()).spawn(move || {
            let _ = p.stream.set_nonblocking(false);
            let reply = respond(&head, &*render);
            write_by(&p.stream, end, &reply);
            let _ = p.stream.shutdown(Shutdown::Both);
            busy.fetch_sub(1, Ordering::SeqCst);
        });
        if spawned.is_err() {
            // The closure and its stream are dropped.
            self.busy.fetch_sub(1, Ordering::SeqCst);
            log::warn!("metrics: cannot start a request's thread");
        }
    }
}

/// Reads what a pending connection has sent, without blocking.
fn read_some(p: &mut Pending, max: usize) -> HeadRead {
    let mut buf = [0u8; 1024];
    loop {
        let n = match (&p.stream).read(&mut buf) {
            Ok(0) => return HeadRead::Gone,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return HeadRead::More,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => return HeadRead::Gone,
        };
        let from = p.head.len().saturating_sub(3);
        p.head.extend_from_slice(&buf[..n]);
        if let Some(at) = p.head[from..].windows(4).position(|w| w == b"\r\n\r\n") {
            let mut head = std::mem::take(&mut p.head);
            head.truncate(from + at);
            return HeadRead::Head(head);
        }
        if p.head.len() > max {
            return HeadRead::TooLong;
        }
    }
}

/// Writes a short answer without blocking (what does not fit in the
/// socket's buffer is dropped) and closes the connection.
fn write_now(stream: &TcpStream, bytes: &[u8]) {
    let mut s = stream;
    let _ = s.write_all(bytes);
    let _ = stream.shutdown(Shutdown::Both);
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

    /// Silent connections hold no slot: with more of them than may wait
    /// (`pending`), and more arriving all the time, every scrape is still
    /// answered at once, and the ones that waited longest were closed to
    /// make room for the newcomers (long before their 6 s deadline). The
    /// endpoint used to give each connection a slot from accept on, so
    /// fresh silent connections kept scrapes out (`503`).
    #[test]
    fn silent_clients_cannot_keep_a_scrape_out() {
        let limits = HttpLimits {
            connections: 4,
            pending: 8,
            deadline: Duration::from_secs(6),
            ..HttpLimits::default()
        };
        let (_srv, addr) = server(limits);
        let mut first = TcpStream::connect(addr).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let churn = {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                let mut held = VecDeque::new();
                while !stop.load(Ordering::SeqCst) {
                    if let Ok(s) = TcpStream::connect(addr) {
                        held.push_back(s);
                    }
                    if held.len() > 64 {
                        held.pop_front();
                    }
                }
            })
        };
        std::thread::sleep(Duration::from_millis(200));
        for _ in 0..20 {
            let t = Instant::now();
            let served = get(addr, b"GET /metrics HTTP/1.1\r\n\r\n");
            assert!(served.starts_with("HTTP/1.1 200"), "{served}");
            assert!(t.elapsed() < Duration::from_secs(3), "a scrape waited {:?}", t.elapsed());
        }
        stop.store(true, Ordering::SeqCst);
        churn.join().unwrap();
        // The oldest silent connection was closed for a newcomer.
        first.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut b = [0u8; 1];
        assert!(matches!(first.read(&mut b), Ok(0) | Err(_)), "the oldest silent connection is still open");
    }
}
