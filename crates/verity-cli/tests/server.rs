//! `verity serve` end to end: a real server process on a loopback port, driven with raw HTTP here and with the
//! official `openai` Python client (tests/python/test_server.py) when Python has it.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct Server {
    child: Child,
    addr: String,
}

impl Server {
    /// A server on a free port. Test servers run side by side and share the cache folder, so none of them
    /// keeps a disk tier of the prefix cache: another server's stored checkpoints of the shared system prompt
    /// would otherwise show up as cached tokens right after a reset.
    fn start(extra: &[&str]) -> Server {
        Self::start_with_env(extra, &[])
    }

    /// A server with `env` set; the caller's own `VERITY_API_KEY` never leaks in.
    fn start_with_env(extra: &[&str], env: &[(&str, &str)]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_verity"))
            .args([
                "--threads",
                "2",
                "serve",
                "--port",
                "0",
                "--prefix-cache-disk-mb",
                "0",
            ])
            .args(extra)
            .env_remove("VERITY_API_KEY")
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("starting verity serve");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = line
            .trim()
            .strip_prefix("listening on http://")
            .unwrap_or_else(|| panic!("unexpected: {line:?}"))
            .to_string();
        Server { child, addr }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One HTTP/1.1 request; returns (status, body).
fn http(addr: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    let r = request(
        addr,
        method,
        path,
        &[("Host", addr), ("Content-Type", "application/json")],
        body,
    );
    (r.status, r.body)
}

struct Reply {
    status: u16,
    /// The status line and headers, header names lower-cased.
    head: String,
    body: String,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().find_map(|l| {
            let (n, v) = l.split_once(':')?;
            (n == name).then(|| v.trim())
        })
    }
}

/// One HTTP/1.1 request with exactly these headers (plus Content-Length and Connection: close).
fn request(addr: &str, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> Reply {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let mut head = format!("{method} {path} HTTP/1.1\r\n");
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    write!(
        s,
        "{head}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    parse_reply(&resp)
}

fn parse_reply(resp: &str) -> Reply {
    let status = resp
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP response: {resp:?}"));
    let (head, body) = resp.split_once("\r\n\r\n").unwrap_or((resp, ""));
    let head = head
        .lines()
        .map(|l| match l.split_once(':') {
            Some((n, v)) => format!("{}:{v}", n.to_ascii_lowercase()),
            None => l.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n");
    Reply {
        status,
        head,
        body: body.to_string(),
    }
}

/// Assert an OpenAI-style error body: `{"error": {"message": "...", "type": "...", ...}}`; returns `error`.
fn openai_error(r: &Reply, status: u16) -> serde_json::Value {
    assert_eq!(r.status, status, "{}\n{}", r.head, r.body);
    let v: serde_json::Value = serde_json::from_str(&r.body)
        .unwrap_or_else(|_| panic!("not JSON: {}\n{}", r.head, r.body));
    let e = &v["error"];
    assert!(
        e["message"].as_str().is_some_and(|m| !m.is_empty()) && e["type"].is_string(),
        "{}",
        r.body
    );
    e.clone()
}

/// Send raw bytes, then read until the server closes the connection or `patience` runs out. Returns what came
/// back and how long after the send the connection ended (`None`: it was still open).
fn exchange(addr: &str, bytes: &[u8], patience: Duration) -> (String, Option<Duration>) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(bytes).unwrap();
    let t = Instant::now();
    read_until_closed(&mut s, t, patience)
}

fn read_until_closed(
    s: &mut TcpStream,
    t: Instant,
    patience: Duration,
) -> (String, Option<Duration>) {
    let mut got = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        let left = patience.saturating_sub(t.elapsed());
        if left.is_zero() {
            return (String::from_utf8_lossy(&got).into_owned(), None);
        }
        s.set_read_timeout(Some(left)).unwrap();
        match s.read(&mut buf) {
            Ok(0) => {
                return (
                    String::from_utf8_lossy(&got).into_owned(),
                    Some(t.elapsed()),
                )
            }
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                return (
                    String::from_utf8_lossy(&got).into_owned(),
                    Some(t.elapsed()),
                )
            }
            Err(_) => return (String::from_utf8_lossy(&got).into_owned(), None),
        }
    }
}

fn chat_body(content: &str, max_tokens: i64, extra: &str) -> String {
    format!(
        r#"{{"messages":[{{"role":"user","content":{content:?}}}],"max_tokens":{max_tokens},"temperature":0{extra}}}"#
    )
}

/// Each chat body sent alone, one after the other; their replies (each must be 200).
fn one_at_a_time(addr: &str, bodies: &[String]) -> Vec<String> {
    bodies
        .iter()
        .map(|b| {
            let (st, reply) = http(addr, "POST", "/v1/chat/completions", b);
            assert_eq!(st, 200, "{reply}");
            reply
        })
        .collect()
}

/// The chat bodies sent from threads of their own, body `i` after a pause of `gap(i)`; the threads.
fn side_by_side(
    addr: &str,
    bodies: &[String],
    gap: impl Fn(usize) -> Duration,
) -> Vec<std::thread::JoinHandle<(u16, String)>> {
    bodies
        .iter()
        .enumerate()
        .map(|(i, b)| {
            let (addr, b) = (addr.to_string(), b.clone());
            std::thread::sleep(gap(i));
            std::thread::spawn(move || http(&addr, "POST", "/v1/chat/completions", &b))
        })
        .collect()
}

/// The replies of [`side_by_side`]'s requests, in order (each must be 200).
fn replies(threads: Vec<std::thread::JoinHandle<(u16, String)>>) -> Vec<String> {
    threads
        .into_iter()
        .map(|t| {
            let (st, reply) = t.join().unwrap();
            assert_eq!(st, 200, "{reply}");
            reply
        })
        .collect()
}

/// The value of a counter or gauge in `/metrics` text.
fn metric(metrics: &str, name: &str) -> u64 {
    let line = metrics
        .lines()
        .find(|l| l.strip_prefix(name).is_some_and(|v| v.starts_with(' ')))
        .unwrap_or_else(|| panic!("no {name} in {metrics}"));
    line[name.len()..].trim().parse().unwrap()
}

/// The message text of a chat completion reply.
fn message(reply: &str) -> serde_json::Value {
    let v: serde_json::Value = serde_json::from_str(reply).unwrap();
    v["choices"][0]["message"]["content"].clone()
}

#[test]
fn serves_chat_and_rejects_bad_input_with_openai_errors() {
    let srv = Server::start(&[]);
    let (st, body) = http(
        &srv.addr,
        "POST",
        "/v1/chat/completions",
        &chat_body("What is the capital of Japan?", 24, ""),
    );
    assert_eq!(st, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert!(
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .contains("Tokyo"),
        "{body}"
    );
    assert_eq!(
        v["usage"]["completion_tokens"].as_u64().unwrap() as usize,
        v["usage"]["total_tokens"].as_u64().unwrap() as usize
            - v["usage"]["prompt_tokens"].as_u64().unwrap() as usize
    );

    for (body, want) in [
        ("{bad json", 400),
        ("[1,2]", 400),
        (r#"{"messages":[]}"#, 400),
        (r#"{"messages":[{"role":"wizard","content":"hi"}]}"#, 400),
        (r#"{"messages":[{"role":"user","content":5}]}"#, 400),
        (&chat_body("hi", 8, r#","top_p":1.5"#), 400),
        (&chat_body("hi", 8, r#","n":3"#), 400),
        (&chat_body("hi", 0, ""), 400),
        (&chat_body("hi", 1_000_000_000, ""), 400),
        (&chat_body("hi", 8, r#","model":"nope""#), 404),
        (&chat_body("hi", 8, r#","top_logprobs":2"#), 400),
        (
            &chat_body("hi", 8, r#","logprobs":true,"top_logprobs":21"#),
            400,
        ),
        (
            &chat_body("hi", 8, r#","stream_options":{"include_usage":true}"#),
            400,
        ),
        (&chat_body("hi", 8, r#","presence_penalty":1"#), 400),
        (&chat_body("hi", -3, ""), 400),
    ] {
        let (st, resp) = http(&srv.addr, "POST", "/v1/chat/completions", body);
        assert_eq!(st, want, "{body} → {resp}");
        let v: serde_json::Value =
            serde_json::from_str(&resp).unwrap_or_else(|_| panic!("not JSON: {resp}"));
        assert!(
            v["error"]["message"].is_string() && v["error"]["type"].is_string(),
            "{resp}"
        );
    }
    let big = "x".repeat(5 << 20);
    let (st, _) = http(&srv.addr, "POST", "/v1/chat/completions", &big);
    assert_eq!(st, 413);
    assert_eq!(http(&srv.addr, "GET", "/health", "").0, 200);
}

/// A streaming request for a 4000-token story, its response begun (the status line read).
fn long_stream(addr: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let body = chat_body(
        "Write a very long story about the sea.",
        4000,
        r#","stream":true,"speculation":"off""#,
    );
    write!(s, "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
    let mut first = [0u8; 512];
    let n = s.read(&mut first).unwrap();
    assert!(String::from_utf8_lossy(&first[..n]).contains("200"));
    s
}

#[test]
fn a_disconnected_stream_is_cancelled_and_a_full_queue_answers_503() {
    // One request at a time: the queue's bound is what this checks.
    let srv = Server::start(&["--queue", "1", "--batch", "1"]);
    // Start a long stream, read a little, hang up.
    drop(long_stream(&srv.addr));
    // The engine must be free again soon: a short request completes well before 4000 tokens could.
    let t = Instant::now();
    let (st, body) = http(
        &srv.addr,
        "POST",
        "/v1/chat/completions",
        &chat_body("Say hi.", 4, ""),
    );
    assert_eq!(st, 200, "{body}");
    assert!(
        t.elapsed() < Duration::from_secs(30),
        "the abandoned generation kept running"
    );
    let metrics = http(&srv.addr, "GET", "/metrics", "").1;
    assert!(
        metrics.contains("verity_requests_cancelled_total 1"),
        "{metrics}"
    );

    // Queue of 1: one running + one waiting; the third is refused at once.
    let addr = srv.addr.clone();
    let long = chat_body(
        "Write a long essay about mountains.",
        300,
        r#","speculation":"off""#,
    );
    let a = std::thread::spawn({
        let (addr, long) = (addr.clone(), long.clone());
        move || http(&addr, "POST", "/v1/chat/completions", &long).0
    });
    std::thread::sleep(Duration::from_millis(300));
    let b = std::thread::spawn({
        let (addr, long) = (addr.clone(), long.clone());
        move || http(&addr, "POST", "/v1/chat/completions", &long).0
    });
    std::thread::sleep(Duration::from_millis(300));
    let (st, body) = http(&addr, "POST", "/v1/chat/completions", &long);
    assert_eq!(st, 503, "{body}");
    assert_eq!(a.join().unwrap(), 200);
    assert_eq!(b.join().unwrap(), 200);
}

/// A client that hangs up in the middle of batched steps ends only its own generation: the requests decoding
/// beside it get bitwise their solo answers, and the metrics count one cancellation.
#[test]
fn a_stream_cancelled_mid_batch_leaves_the_others_answers_unchanged() {
    let srv = Server::start(&[]);
    let bodies = [
        chat_body("Describe a forest in spring.", 64, ""),
        r#"{"messages":[{"role":"user","content":"List some fruits."}],"max_tokens":48,"temperature":0.9,"seed":7}"#
            .to_string(),
    ];
    let solo = one_at_a_time(&srv.addr, &bodies);
    let stream = long_stream(&srv.addr);
    let others = side_by_side(&srv.addr, &bodies, |_| Duration::ZERO);
    std::thread::sleep(Duration::from_millis(150));
    drop(stream);
    for (i, reply) in replies(others).iter().enumerate() {
        assert_eq!(message(reply), message(&solo[i]), "request {i}");
    }
    let metrics = http(&srv.addr, "GET", "/metrics", "").1;
    assert_eq!(metric(&metrics, "verity_requests_cancelled_total"), 1);
    assert!(
        metric(&metrics, "verity_batch_steps_total") > 0,
        "{metrics}"
    );
}

/// Requests decoding together (joining a request that decodes alone, joining a running batch, outliving the
/// others and going on alone) get bitwise the answers they get one at a time: text, finish reason, token
/// counts and log-probabilities, greedy and seeded sampling, on the speculative route and with it off, and
/// under a JSON grammar.
#[test]
fn concurrent_requests_get_their_solo_answers() {
    let srv = Server::start(&[]);
    let body = |q: &str, tokens: usize, extra: &str| {
        format!(
            r#"{{"messages":[{{"role":"user","content":{q:?}}}],"max_tokens":{tokens}{extra}}}"#
        )
    };
    let bodies = [
        body(
            "Write a short story about a lighthouse.",
            96,
            r#","temperature":0"#,
        ),
        body(
            "Describe a cat as a JSON object.",
            48,
            r#","temperature":0.7,"seed":2,"response_format":{"type":"json_object"}"#,
        ),
        body(
            "Name five rivers of Europe.",
            40,
            r#","temperature":0.9,"seed":11"#,
        ),
        body(
            "Write a Python function that reverses a list.",
            64,
            r#","temperature":0,"logprobs":true,"top_logprobs":2"#,
        ),
        body(
            "Describe the moon in two sentences.",
            48,
            r#","temperature":1.0,"seed":5,"speculation":"off""#,
        ),
        body("What is 7 times 8?", 24, r#","temperature":0"#),
    ];
    let answer = |reply: &str| {
        let v: serde_json::Value = serde_json::from_str(reply).unwrap();
        let c = &v["choices"][0];
        (
            c["message"]["content"].clone(),
            c["finish_reason"].clone(),
            v["usage"]["completion_tokens"].clone(),
            c["logprobs"].clone(),
        )
    };
    let solo = one_at_a_time(&srv.addr, &bodies);
    // The first starts alone; the others arrive while it decodes, one after the batch has formed.
    let gap = |i| Duration::from_millis(if i == 4 { 400 } else { 60 });
    let together = replies(side_by_side(&srv.addr, &bodies, gap));
    for (i, reply) in together.iter().enumerate() {
        assert_eq!(
            answer(reply),
            answer(&solo[i]),
            "request {i}: its answer beside others differs from alone"
        );
    }
    let metrics = http(&srv.addr, "GET", "/metrics", "").1;
    assert_eq!(metric(&metrics, "verity_active_generations"), 0);
    assert!(
        metric(&metrics, "verity_batch_steps_total") > 0,
        "{metrics}"
    );
    assert!(
        metric(&metrics, "verity_batch_joins_from_alone_total") > 0,
        "{metrics}"
    );
}

/// With a KV budget that holds one request's cache (SmolLM2's first 256 slots: 11.25 MiB), concurrent requests
/// decode one after another, each with its solo answer, and never in batched steps; the metrics count the waits.
/// A request whose cache alone would pass the budget is refused with an error that says so.
#[test]
fn the_kv_budget_makes_requests_wait_and_refuses_what_never_fits() {
    let srv = Server::start(&["--kv-budget-mb", "16"]);
    let bodies = [
        chat_body("Name three colours.", 40, ""),
        r#"{"messages":[{"role":"user","content":"Count from one to five."}],"max_tokens":40,"temperature":0.8,"seed":3}"#
            .to_string(),
        chat_body("What is the capital of Italy?", 40, ""),
    ];
    let solo = one_at_a_time(&srv.addr, &bodies);
    let together = replies(side_by_side(&srv.addr, &bodies, |_| {
        Duration::from_millis(60)
    }));
    for (i, reply) in together.iter().enumerate() {
        assert_eq!(message(reply), message(&solo[i]), "request {i}");
    }
    let metrics = http(&srv.addr, "GET", "/metrics", "").1;
    assert!(
        metric(&metrics, "verity_kv_budget_waits_total") >= 1,
        "{metrics}"
    );
    assert_eq!(metric(&metrics, "verity_batch_steps_total"), 0);
    let (st, reply) = http(
        &srv.addr,
        "POST",
        "/v1/chat/completions",
        &chat_body("Tell me a long story.", 600, ""),
    );
    assert_eq!(st, 400, "{reply}");
    assert!(
        reply.contains("KV cache") && reply.contains("16 MiB"),
        "{reply}"
    );
}

/// Send SIGTERM to the server and wait (up to `patience`) for it to exit; returns whether it exited cleanly.
#[cfg(unix)]
fn terminate(srv: &mut Server, patience: Duration) -> bool {
    let pid = srv.child.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let t = Instant::now();
    while t.elapsed() < patience {
        if let Some(status) = srv.child.try_wait().unwrap() {
            return status.success();
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("the server did not exit within {patience:?} of SIGTERM");
}

#[cfg(unix)]
#[test]
fn sigterm_lets_the_request_in_progress_finish_then_exits() {
    let mut srv = Server::start(&["--shutdown-grace-s", "60"]);
    let addr = srv.addr.clone();
    let body = chat_body(
        "Write a very long story about the sea.",
        300,
        r#","speculation":"off""#,
    );
    let running = std::thread::spawn(move || http(&addr, "POST", "/v1/chat/completions", &body));
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        !running.is_finished(),
        "the request ended before the signal"
    );
    assert!(terminate(&mut srv, Duration::from_secs(60)));
    let (st, body) = running.join().unwrap();
    assert_eq!(st, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{body}");
    assert_eq!(v["usage"]["completion_tokens"], 300, "{body}");
    assert!(
        TcpStream::connect(&srv.addr).is_err(),
        "the server still accepts connections"
    );
}

#[cfg(unix)]
#[test]
fn past_the_shutdown_grace_the_generation_is_cancelled_and_queued_requests_get_503() {
    let mut srv = Server::start(&["--shutdown-grace-s", "0.5", "--batch", "1"]);
    // A long stream in progress, and a request waiting behind it.
    let mut s = long_stream(&srv.addr);
    let addr = srv.addr.clone();
    let queued = std::thread::spawn(move || {
        http(
            &addr,
            "POST",
            "/v1/chat/completions",
            &chat_body("Say hi.", 4, ""),
        )
    });
    std::thread::sleep(Duration::from_millis(300));
    let t = Instant::now();
    assert!(terminate(&mut srv, Duration::from_secs(30)));
    assert!(
        t.elapsed() < Duration::from_secs(20),
        "a 4000-token generation was not cut at the grace"
    );
    let mut rest = String::new();
    let _ = s.read_to_string(&mut rest);
    assert!(rest.contains(r#""finish_reason":"cancelled""#), "{rest}");
    assert!(rest.contains("data: [DONE]"), "{rest}");
    let (st, body) = queued.join().unwrap();
    assert_eq!(st, 503, "{body}");
    assert!(body.contains("server_shutting_down"), "{body}");
}

#[test]
fn silent_dribbling_and_idle_clients_are_timed_out() {
    let srv = Server::start(&[
        "--header-timeout-s",
        "1",
        "--body-timeout-s",
        "1",
        "--idle-timeout-s",
        "1",
    ]);
    let prompt = Duration::from_secs(5);
    // A connection that never sends a byte is closed without an answer.
    let (got, closed) = exchange(&srv.addr, b"", prompt);
    let closed = closed.expect("a silent connection stayed open");
    assert!(
        got.is_empty() && closed >= Duration::from_millis(800),
        "{got:?} after {closed:?}"
    );

    // A head that never ends is answered 408, however steadily it dribbles in.
    let mut s = TcpStream::connect(&srv.addr).unwrap();
    s.write_all(b"GET /health HTTP/1.1\r\nX-Slow: ").unwrap();
    let t = Instant::now();
    let dribbler = std::thread::spawn({
        let mut s = s.try_clone().unwrap();
        move || {
            while t.elapsed() < Duration::from_secs(10) && s.write_all(b"a").is_ok() {
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    });
    let (got, closed) = read_until_closed(&mut s, t, prompt);
    let closed = closed.expect("a dribbled head kept its connection open");
    openai_error(&parse_reply(&got), 408);
    assert!(closed < Duration::from_secs(3), "closed after {closed:?}");
    drop(s);
    dribbler.join().unwrap();

    // A body that never arrives is answered 408.
    let (got, closed) = exchange(
        &srv.addr,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"messages\":",
        prompt,
    );
    assert_eq!(
        openai_error(&parse_reply(&got), 408)["type"],
        "request_timeout"
    );
    assert!(closed.is_some(), "the connection stayed open after the 408");

    // A kept-alive connection is closed after the idle timeout.
    let mut s = TcpStream::connect(&srv.addr).unwrap();
    s.write_all(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .unwrap();
    let mut buf = [0u8; 1024];
    let n = s.read(&mut buf).unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).ends_with("{\"status\":\"ok\"}"));
    let (_, closed) = read_until_closed(&mut s, Instant::now(), prompt);
    let closed = closed.expect("an idle connection stayed open");
    assert!(
        closed >= Duration::from_millis(700),
        "closed after {closed:?}"
    );
}

#[test]
fn generation_outlasting_every_timeout_is_not_cut() {
    let srv = Server::start(&[
        "--header-timeout-s",
        "0.3",
        "--body-timeout-s",
        "0.3",
        "--idle-timeout-s",
        "0.3",
    ]);
    // A stream and, queued behind it, a plain answer: the second connection sends and receives nothing while
    // both generate, far longer than any timeout.
    let streamed = chat_body(
        "Write a long story about the sea.",
        128,
        r#","stream":true,"speculation":"off""#,
    );
    let plain = chat_body(
        "Write a long story about a mountain.",
        128,
        r#","speculation":"off""#,
    );
    let t = Instant::now();
    let a = std::thread::spawn({
        let addr = srv.addr.clone();
        move || http(&addr, "POST", "/v1/chat/completions", &streamed)
    });
    std::thread::sleep(Duration::from_millis(100));
    let (st, body) = http(&srv.addr, "POST", "/v1/chat/completions", &plain);
    let waited = t.elapsed();
    assert_eq!(st, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() > 0);
    let (st, stream) = a.join().unwrap();
    assert_eq!(st, 200);
    assert!(stream.contains("data: [DONE]"), "{stream}");
    assert!(
        waited > Duration::from_millis(900),
        "generation was too fast ({waited:?}) to outlast the timeouts; ask for more tokens"
    );
}

#[test]
fn connections_over_the_cap_are_refused_at_once() {
    let srv = Server::start(&["--max-connections", "2"]);
    let hold = |addr: &str| {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
            .unwrap();
        let mut buf = [0u8; 1024];
        assert!(s.read(&mut buf).unwrap() > 0);
        s
    };
    let first = hold(&srv.addr);
    let _second = hold(&srv.addr);
    for _ in 0..3 {
        let (got, closed) = exchange(
            &srv.addr,
            b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n",
            Duration::from_secs(5),
        );
        let closed = closed.expect("a connection over the cap was kept waiting");
        assert!(closed < Duration::from_secs(2), "refused after {closed:?}");
        assert_eq!(
            openai_error(&parse_reply(&got), 503)["type"],
            "server_overloaded"
        );
    }
    // A freed slot serves again.
    drop(first);
    let t = Instant::now();
    loop {
        let (got, _) = exchange(
            &srv.addr,
            b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
            Duration::from_secs(5),
        );
        if parse_reply(&got).status == 200 {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(5), "no slot came free");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn protocol_errors_come_back_as_openai_json() {
    let srv = Server::start(&[]);
    let long_uri = format!(
        "GET /health?{} HTTP/1.1\r\nHost: localhost\r\n\r\n",
        "a".repeat(10_000)
    );
    let big_header = format!(
        "GET /health HTTP/1.1\r\nHost: localhost\r\nX-Big: {}\r\n\r\n",
        "a".repeat(70_000)
    );
    let many_headers = format!(
        "GET /health HTTP/1.1\r\nHost: localhost\r\n{}\r\n",
        (0..120)
            .map(|i| format!("X-{i}: 1\r\n"))
            .collect::<String>()
    );
    let post = "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n";
    for (request, status) in [
        (long_uri, 414),
        (big_header, 431),
        (many_headers, 431),
        ("GARBAGE\r\n\r\n".to_string(), 400),
        ("GET / HTTP/9.9\r\n\r\n".to_string(), 400),
        (format!("{post}Content-Length: ten\r\n\r\n"), 400),
        (
            format!("{post}Content-Length: 5\r\nContent-Length: 6\r\n\r\nhello!"),
            400,
        ),
        (format!("{post}Transfer-Encoding: gzip\r\n\r\n"), 400),
        (
            format!("{post}Transfer-Encoding: chunked\r\n\r\nzz\r\n"),
            400,
        ),
    ] {
        let (got, _) = exchange(&srv.addr, request.as_bytes(), Duration::from_secs(10));
        let reply = parse_reply(&got);
        openai_error(&reply, status);
        assert_eq!(
            reply.header("content-type"),
            Some("application/json"),
            "{}",
            reply.head
        );
    }
    assert_eq!(http(&srv.addr, "GET", "/health", "").0, 200);
}

#[test]
fn an_api_key_guards_everything_but_health() {
    let srv = Server::start(&["--api-key", "sekret"]);
    let host = ("Host", "localhost");
    let get = |path: &str, auth: Option<&str>| {
        let mut headers = vec![host];
        headers.extend(auth.map(|a| ("Authorization", a)));
        request(&srv.addr, "GET", path, &headers, "")
    };
    assert_eq!(get("/health", None).status, 200);
    for (path, auth) in [
        ("/v1/models", None),
        ("/v1/models", Some("Bearer wrong")),
        ("/v1/models", Some("Bearer sekre")),
        ("/v1/models", Some("Basic sekret")),
        ("/metrics", None),
        ("/nowhere", None),
    ] {
        let r = get(path, auth);
        assert_eq!(openai_error(&r, 401)["code"], "invalid_api_key", "{path}");
        assert_eq!(r.header("www-authenticate"), Some("Bearer"));
    }
    assert_eq!(get("/v1/models", Some("Bearer sekret")).status, 200);
    assert_eq!(get("/metrics", Some("bearer sekret")).status, 200);
    let r = request(
        &srv.addr,
        "POST",
        "/v1/chat/completions",
        &[host, ("Content-Type", "application/json")],
        &chat_body("hi", 2, ""),
    );
    openai_error(&r, 401);

    // The key may come from the environment instead.
    let srv = Server::start_with_env(&[], &[("VERITY_API_KEY", "from-env")]);
    let get = |auth: &[(&str, &str)]| {
        let mut headers = vec![host];
        headers.extend_from_slice(auth);
        request(&srv.addr, "GET", "/v1/models", &headers, "").status
    };
    assert_eq!(get(&[]), 401);
    assert_eq!(get(&[("Authorization", "Bearer from-env")]), 200);
}

/// Run `verity serve` with `args` and wait for it to exit (killing it after `patience`); (exit success, stderr).
fn serve_exit(args: &[&str], patience: Duration) -> Option<(bool, String)> {
    let mut child = Command::new(env!("CARGO_BIN_EXE_verity"))
        .arg("serve")
        .args(args)
        .env_remove("VERITY_API_KEY")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while t.elapsed() < patience {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut err)
                .unwrap();
            return Some((status.success(), err));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    None
}

#[test]
fn a_network_bind_without_a_key_is_refused_unless_waived() {
    for host in ["0.0.0.0", "::"] {
        let (ok, err) = serve_exit(&["--host", host, "--port", "0"], Duration::from_secs(30))
            .expect("verity serve listened on the network without an API key");
        assert!(!ok && err.contains("--api-key"), "{err}");
    }
    let (ok, err) = serve_exit(
        &["--port", "0", "--cors-origin", "localhost:3000"],
        Duration::from_secs(30),
    )
    .expect("a bad --cors-origin was accepted");
    assert!(!ok && err.contains("--cors-origin"), "{err}");

    // Waived: it serves, with a warning.
    let mut child = Command::new(env!("CARGO_BIN_EXE_verity"))
        .args([
            "--threads",
            "2",
            "serve",
            "--host",
            "0.0.0.0",
            "--port",
            "0",
        ])
        .args(["--prefix-cache-disk-mb", "0", "--allow-no-api-key"])
        .env_remove("VERITY_API_KEY")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let _ = child.kill();
    let _ = child.wait();
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(line.starts_with("listening on http://0.0.0.0:"), "{line}");
    assert!(
        err.contains("warning") && err.contains("without an API key"),
        "{err}"
    );
}

#[test]
fn web_pages_cannot_drive_the_server_uninvited() {
    let srv = Server::start(&[
        "--cors-origin",
        "http://localhost:3000",
        "--allowed-host",
        "verity.lan",
    ]);
    let addr = srv.addr.as_str();
    let json = ("Content-Type", "application/json");
    // A page's "simple" POST (text/plain, or no type at all) never reaches a handler.
    for ty in [
        Some("text/plain"),
        Some("application/x-www-form-urlencoded"),
        None,
    ] {
        let mut headers = vec![("Host", addr)];
        headers.extend(ty.map(|t| ("Content-Type", t)));
        let r = request(addr, "POST", "/v1/cache/reset", &headers, "{}");
        openai_error(&r, 415);
    }
    let r = request(
        addr,
        "POST",
        "/v1/cache/reset",
        &[
            ("Host", addr),
            ("Content-Type", "application/json; charset=utf-8"),
        ],
        "{}",
    );
    assert_eq!(r.status, 200, "{}", r.body);

    // DNS rebinding: the page's own name arrives as the Host.
    for (host, status) in [
        ("evil.example", 421),
        ("evil.example:8080", 421),
        ("localhost", 200),
        ("localhost:9", 200),
        ("[::1]:8080", 200),
        ("127.0.0.1", 200),
        ("verity.lan:8080", 200),
    ] {
        let r = request(addr, "GET", "/v1/models", &[("Host", host)], "");
        if status == 200 {
            assert_eq!(r.status, 200, "{host}: {}", r.body);
        } else {
            openai_error(&r, status);
        }
    }

    // Cross-origin: refused unless allowed; allowed ones get CORS headers and preflight answers.
    let r = request(
        addr,
        "GET",
        "/health",
        &[("Host", addr), ("Origin", "http://evil.example")],
        "",
    );
    openai_error(&r, 403);
    let r = request(
        addr,
        "POST",
        "/v1/cache/reset",
        &[("Host", addr), ("Origin", "null"), json],
        "{}",
    );
    openai_error(&r, 403);
    let r = request(
        addr,
        "GET",
        "/v1/models",
        &[("Host", addr), ("Origin", "http://localhost:3000")],
        "",
    );
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("access-control-allow-origin"),
        Some("http://localhost:3000")
    );
    let preflight = |origin: &str| {
        request(
            addr,
            "OPTIONS",
            "/v1/chat/completions",
            &[
                ("Host", addr),
                ("Origin", origin),
                ("Access-Control-Request-Method", "POST"),
                (
                    "Access-Control-Request-Headers",
                    "authorization, content-type",
                ),
            ],
            "",
        )
    };
    let r = preflight("http://localhost:3000");
    assert_eq!(r.status, 204, "{}", r.head);
    assert_eq!(
        r.header("access-control-allow-origin"),
        Some("http://localhost:3000")
    );
    assert!(r
        .header("access-control-allow-methods")
        .is_some_and(|m| m.contains("POST")));
    assert_eq!(
        r.header("access-control-allow-headers"),
        Some("authorization, content-type")
    );
    openai_error(&preflight("http://evil.example"), 403);
    // Clients that are not browsers send no Origin and are unaffected.
    assert_eq!(http(addr, "GET", "/v1/models", "").0, 200);
}

/// Run one of the official-client suites (`tests/python/<script>`) against a keyed server; skipped, loudly,
/// when Python lacks `module`, unless `require` is set (CI installs the clients and sets it).
fn client_suite_passes(script: &str, module: &str, require: &str) {
    let script = format!("{}/tests/python/{script}", env!("CARGO_MANIFEST_DIR"));
    assert!(
        std::path::Path::new(&script).exists(),
        "{script} is missing"
    );
    let has_client = Command::new("python3")
        .args(["-c", &format!("import {module}")])
        .status()
        .is_ok_and(|s| s.success());
    if !has_client {
        assert!(
            std::env::var_os(require).is_none(),
            "python3 has no `{module}` package"
        );
        eprintln!("SKIPPED: python3 has no `{module}` package (pip install {module}); .ci/run installs it");
        return;
    }
    // With a key, so that the client's own authentication is exercised too.
    let srv = Server::start(&["--api-key", "verity-test"]);
    let out = Command::new("python3")
        .args([
            &script,
            "--base-url",
            &format!("http://{}", srv.addr),
            "--model",
            "smollm2-135m",
            "--api-key",
            "verity-test",
        ])
        .output()
        .unwrap();
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
}

/// The official `openai` client suite.
#[test]
fn openai_python_client_suite_passes() {
    client_suite_passes("test_server.py", "openai", "VERITY_REQUIRE_OPENAI");
}

/// The official `anthropic` client suite against `POST /v1/messages` (the client sends the key as x-api-key).
#[test]
fn anthropic_python_client_suite_passes() {
    client_suite_passes("test_anthropic.py", "anthropic", "VERITY_REQUIRE_ANTHROPIC");
}

/// Standard base64, for the images the tests send.
fn base64(bytes: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for c in bytes.chunks(3) {
        let n = (u32::from(c[0]) << 16)
            | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
            | u32::from(*c.get(2).unwrap_or(&0));
        for i in 0..4 {
            if i <= c.len() {
                out.push(A[(n >> (18 - 6 * i)) as usize & 63] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// One image-text bundle's server: see [`chat_requests_carry_images_in_both_apis`].
fn images_are_served(bundle: &Path, png: &[u8], with_image: &str, block: u64) {
    let s = Server::start(&["--model", bundle.to_str().unwrap()]);
    let openai = |content: &str| {
        let body = format!(
            r#"{{"messages":[{{"role":"user","content":{content}}}],"max_tokens":3,"temperature":0}}"#
        );
        http(&s.addr, "POST", "/v1/chat/completions", &body)
    };
    let prompt_tokens = |body: &str| -> u64 {
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        v["usage"]["prompt_tokens"].as_u64().unwrap()
    };
    let (status, body) = openai(with_image);
    assert_eq!(status, 200, "{body}");
    let (status, text_only) = openai(r#""Describe it.""#);
    assert_eq!(status, 200, "{text_only}");
    assert!(
        prompt_tokens(&body) >= prompt_tokens(&text_only) + block,
        "{body}"
    );
    // Again: the image turn's prefix comes from the prefix cache.
    let (status, again) = openai(with_image);
    assert_eq!(status, 200);
    let v: serde_json::Value = serde_json::from_str(&again).unwrap();
    assert!(
        v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0)
            > block,
        "{again}"
    );
    for bad in [
        r#"[{"type":"image_url","image_url":{"url":"https://example.com/cat.png"}}]"#.to_string(),
        r#"[{"type":"image_url","image_url":{"url":"data:image/png;base64,@@@"}}]"#.to_string(),
        format!(
            r#"[{{"type":"image_url","image_url":{{"url":"data:image/png;base64,{}"}}}}]"#,
            base64(&png[..png.len() / 2])
        ),
    ] {
        let (status, body) = openai(&bad);
        assert_eq!(status, 400, "{bad}: {body}");
    }
    // The Messages API's base64 image block.
    let body = format!(
        r#"{{"model":"{}","max_tokens":3,"messages":[{{"role":"user","content":[{{"type":"image","source":{{"type":"base64","media_type":"image/png","data":"{}"}}}},{{"type":"text","text":"Describe it."}}]}}]}}"#,
        bundle.file_name().unwrap().to_str().unwrap(),
        base64(png)
    );
    let (status, reply) = http(&s.addr, "POST", "/v1/messages", &body);
    assert_eq!(status, 200, "{reply}");
}

/// Images in both APIs, on the tiny Gemma 3 and Qwen2.5-VL image-text bundles: an OpenAI `image_url` part with a
/// base64 data URL and an Anthropic base64 `image` block are answered (the prompt holds the image's block: at
/// least `block` ids more than the text alone); the same request twice restores the image turn's prefix from
/// the prefix cache; a remote URL is never fetched, and a broken image, bad base64 or a text-only model get a
/// 4xx.
#[test]
fn chat_requests_carry_images_in_both_apis() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../verity/tests/fixtures");
    let png = std::fs::read(fixtures.join("images/rgb.png")).unwrap();
    let url = format!("data:image/png;base64,{}", base64(&png));
    let with_image = format!(
        r#"[{{"type":"image_url","image_url":{{"url":"{url}"}}}},{{"type":"text","text":"Describe it."}}]"#
    );
    for (name, block) in [("gemma3-vl", 6), ("qwen25-vl", 22)] {
        images_are_served(
            &fixtures.join("vision").join(name),
            &png,
            &with_image,
            block,
        );
    }
    // A text-only model refuses images.
    let s = Server::start(&["--model", fixtures.join("hf/llama-f32").to_str().unwrap()]);
    let body =
        format!(r#"{{"messages":[{{"role":"user","content":{with_image}}}],"max_tokens":2}}"#);
    let (status, reply) = http(&s.addr, "POST", "/v1/chat/completions", &body);
    assert!((400..500).contains(&status), "{status}: {reply}");
}
