//! Server metrics in the Prometheus text format.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

use verity::engine::GenerationStats;

/// TTFT histogram bucket bounds, seconds.
const TTFT_BUCKETS: &[f64] = &[0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];

#[derive(Default)]
pub struct Metrics {
    pub requests: AtomicU64,
    pub errors: AtomicU64,
    pub rejected: AtomicU64,
    pub cancelled: AtomicU64,
    pub queue_depth: AtomicI64,
    /// Generations running now (the batch, and a request decoding alone).
    pub active: AtomicI64,
    /// Batched steps taken (each one forward of every batched request's rows), and the tokens they
    /// gave; requests moved from decoding alone into a batch.
    pub batch_steps: AtomicU64,
    pub batch_tokens: AtomicU64,
    pub handovers: AtomicU64,
    /// Requests that waited for the KV budget before starting.
    pub kv_waits: AtomicU64,
    /// Bytes of K/V the sessions' caches hold, and the prefix cache's RAM checkpoints and their bytes, as of
    /// the last request's end.
    pub kv_bytes: AtomicU64,
    pub prefix_entries: AtomicU64,
    pub prefix_bytes: AtomicU64,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    prompt_tokens: u64,
    completion_tokens: u64,
    cached_tokens: u64,
    prefix_hits: u64,
    decode_s: f64,
    ttft_sum: f64,
    ttft_count: u64,
    ttft_buckets: [u64; 8],
    /// route → (cycles, drafted, accepted)
    spec: BTreeMap<&'static str, (u64, u64, u64)>,
}

impl Metrics {
    pub fn record(&self, s: &GenerationStats) {
        let mut m = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        m.prompt_tokens += s.prompt_tokens as u64;
        m.completion_tokens += s.completion_tokens as u64;
        m.cached_tokens += s.restored_tokens as u64;
        m.prefix_hits += (s.restored_tokens > 0) as u64;
        m.decode_s += s.decode_s;
        m.ttft_sum += s.ttft_s;
        m.ttft_count += 1;
        for (i, &b) in TTFT_BUCKETS.iter().enumerate() {
            if s.ttft_s <= b {
                m.ttft_buckets[i] += 1;
            }
        }
        let e = m.spec.entry(s.route).or_default();
        e.0 += s.cycles as u64;
        e.1 += s.drafted as u64;
        e.2 += s.accepted as u64;
    }

    pub fn render(&self) -> String {
        let m = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let mut o = String::new();
        let mut counter = |name: &str, help: &str, v: String| {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
        };
        counter(
            "verity_requests_total",
            "Generation requests received.",
            self.requests.load(Relaxed).to_string(),
        );
        counter(
            "verity_request_errors_total",
            "Requests answered with an error.",
            self.errors.load(Relaxed).to_string(),
        );
        counter(
            "verity_requests_rejected_total",
            "Requests refused because the queue was full.",
            self.rejected.load(Relaxed).to_string(),
        );
        counter(
            "verity_requests_cancelled_total",
            "Generations cancelled by a disconnected client.",
            self.cancelled.load(Relaxed).to_string(),
        );
        counter(
            "verity_prompt_tokens_total",
            "Prompt tokens processed.",
            m.prompt_tokens.to_string(),
        );
        counter(
            "verity_completion_tokens_total",
            "Completion tokens generated.",
            m.completion_tokens.to_string(),
        );
        counter(
            "verity_prefix_cache_restored_tokens_total",
            "Prompt tokens restored from the cache.",
            m.cached_tokens.to_string(),
        );
        counter(
            "verity_prefix_cache_hits_total",
            "Requests that reused a cached prefix.",
            m.prefix_hits.to_string(),
        );
        counter(
            "verity_batch_steps_total",
            "Batched decode steps (one forward of every batched request's next token).",
            self.batch_steps.load(Relaxed).to_string(),
        );
        counter(
            "verity_batch_tokens_total",
            "Tokens decoded in batched steps.",
            self.batch_tokens.load(Relaxed).to_string(),
        );
        counter(
            "verity_batch_joins_from_alone_total",
            "Requests that decoded alone and moved into batched steps when others arrived.",
            self.handovers.load(Relaxed).to_string(),
        );
        counter(
            "verity_kv_budget_waits_total",
            "Requests that waited for the KV budget before they started.",
            self.kv_waits.load(Relaxed).to_string(),
        );
        let _ = writeln!(
            o,
            "# HELP verity_queue_depth Requests waiting.\n# TYPE verity_queue_depth gauge"
        );
        let _ = writeln!(
            o,
            "verity_queue_depth {}",
            self.queue_depth.load(Relaxed).max(0)
        );
        let mut gauge = |name: &str, help: &str, v: String| {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        };
        gauge(
            "verity_active_generations",
            "Generations running now.",
            self.active.load(Relaxed).max(0).to_string(),
        );
        gauge(
            "verity_kv_cache_bytes",
            "Bytes of K/V held by the sessions' caches (live and idle).",
            self.kv_bytes.load(Relaxed).to_string(),
        );
        gauge(
            "verity_prefix_cache_ram_entries",
            "Prefix-cache checkpoints held in RAM.",
            self.prefix_entries.load(Relaxed).to_string(),
        );
        gauge(
            "verity_prefix_cache_ram_bytes",
            "Bytes of the prefix-cache checkpoints held in RAM.",
            self.prefix_bytes.load(Relaxed).to_string(),
        );
        let tps = if m.decode_s > 0.0 {
            m.completion_tokens as f64 / m.decode_s
        } else {
            0.0
        };
        let _ = writeln!(
            o,
            "# HELP verity_decode_tokens_per_second Completion tokens per second of decode time."
        );
        let _ = writeln!(o, "# TYPE verity_decode_tokens_per_second gauge\nverity_decode_tokens_per_second {tps:.3}");
        let _ = writeln!(
            o,
            "# HELP verity_ttft_seconds Time to first token.\n# TYPE verity_ttft_seconds histogram"
        );
        for (i, b) in TTFT_BUCKETS.iter().enumerate() {
            let _ = writeln!(
                o,
                "verity_ttft_seconds_bucket{{le=\"{b}\"}} {}",
                m.ttft_buckets[i]
            );
        }
        let _ = writeln!(
            o,
            "verity_ttft_seconds_bucket{{le=\"+Inf\"}} {}",
            m.ttft_count
        );
        let _ = writeln!(
            o,
            "verity_ttft_seconds_sum {:.6}\nverity_ttft_seconds_count {}",
            m.ttft_sum, m.ttft_count
        );
        let _ = writeln!(o, "# HELP verity_spec_cycles_total Verify forwards per route.\n# TYPE verity_spec_cycles_total counter");
        for (route, (c, _, _)) in &m.spec {
            let _ = writeln!(o, "verity_spec_cycles_total{{route=\"{route}\"}} {c}");
        }
        let _ = writeln!(o, "# HELP verity_spec_drafted_tokens_total Drafted tokens per route.\n# TYPE verity_spec_drafted_tokens_total counter");
        for (route, (_, d, _)) in &m.spec {
            let _ = writeln!(
                o,
                "verity_spec_drafted_tokens_total{{route=\"{route}\"}} {d}"
            );
        }
        let _ = writeln!(o, "# HELP verity_spec_accepted_tokens_total Accepted drafted tokens per route.\n# TYPE verity_spec_accepted_tokens_total counter");
        for (route, (_, _, a)) in &m.spec {
            let _ = writeln!(
                o,
                "verity_spec_accepted_tokens_total{{route=\"{route}\"}} {a}"
            );
        }
        o
    }
}
