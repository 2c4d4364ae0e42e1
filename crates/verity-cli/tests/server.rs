//! `verity serve` end to end: a real server process on a loopback port, driven with raw HTTP here and with the
//! official `openai` Python client (tests/python/test_server.py) when Python has it.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
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
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let status = resp.split_whitespace().nth(1).unwrap().parse().unwrap();
    let body = resp
        .split_once("\r\n\r\n")
        .map(|x| x.1.to_string())
        .unwrap_or_default();
    (status, body)
}

fn chat_body(content: &str, max_tokens: usize, extra: &str) -> String {
    format!(
        r#"{{"messages":[{{"role":"user","content":{content:?}}}],"max_tokens":{max_tokens},"temperature":0{extra}}}"#
    )
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

#[test]
fn a_disconnected_stream_is_cancelled_and_a_full_queue_answers_503() {
    let srv = Server::start(&["--queue", "1"]);
    // Start a long stream, read a little, hang up.
    let mut s = TcpStream::connect(&srv.addr).unwrap();
    let body = chat_body(
        "Write a very long story about the sea.",
        4000,
        r#","stream":true,"speculation":"off""#,
    );
    write!(s, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
    let mut buf = [0u8; 2048];
    let n = s.read(&mut buf).unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).contains("200"));
    drop(s);
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

/// The official `openai` client suite (skipped, loudly, when Python lacks the package; CI installs it).
#[test]
fn openai_python_client_suite_passes() {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/test_server.py");
    if !std::path::Path::new(script).exists() {
        panic!("{script} is missing");
    }
    let has_openai = Command::new("python3")
        .args(["-c", "import openai"])
        .status()
        .is_ok_and(|s| s.success());
    if !has_openai {
        // CI sets VERITY_REQUIRE_OPENAI so that a missing client fails instead of skipping.
        assert!(
            std::env::var_os("VERITY_REQUIRE_OPENAI").is_none(),
            "python3 has no `openai` package"
        );
        eprintln!(
            "SKIPPED: python3 has no `openai` package (pip install openai); .ci/run installs it"
        );
        return;
    }
    let srv = Server::start(&[]);
    let out = Command::new("python3")
        .args([
            script,
            "--base-url",
            &format!("http://{}", srv.addr),
            "--model",
            "smollm2-135m",
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
