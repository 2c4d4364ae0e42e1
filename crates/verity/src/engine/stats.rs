//! Uniform statistics of a generation, the same for every route (llama.cpp prints one such block per
//! speculative implementation; verity records them in every bench record).

use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// A stop token (EOS / end of turn) was produced; it is not part of the completion.
    Stop,
    MaxTokens,
    ContextFull,
    /// The token callback asked to stop.
    Cancelled,
}

#[derive(Debug, Clone)]
pub struct GenerationStats {
    pub route: &'static str,
    pub prompt_tokens: usize,
    /// Prompt tokens whose K/V were already in the session cache.
    pub restored_tokens: usize,
    pub completion_tokens: usize,
    pub ttft_s: f64,
    /// From the first completion token to the last.
    pub decode_s: f64,
    pub stop: StopReason,
    /// Verify forwards (one per cycle; AR: one per token).
    pub cycles: usize,
    pub drafted: usize,
    pub accepted: usize,
    pub draft_s: f64,
    pub verify_s: f64,
    /// Verification decisions, commits and bookkeeping.
    pub other_s: f64,
    /// Time spent storing the prefix-cache checkpoint during prefill.
    pub store_s: f64,
}

impl GenerationStats {
    pub fn new(route: &'static str) -> Self {
        GenerationStats {
            route,
            prompt_tokens: 0,
            restored_tokens: 0,
            completion_tokens: 0,
            ttft_s: 0.0,
            decode_s: 0.0,
            stop: StopReason::MaxTokens,
            cycles: 0,
            drafted: 0,
            accepted: 0,
            draft_s: 0.0,
            verify_s: 0.0,
            other_s: 0.0,
            store_s: 0.0,
        }
    }

    pub(crate) fn record_cycle(
        &mut self,
        drafted: usize,
        accepted: usize,
        draft: Duration,
        verify: Duration,
        other: Duration,
    ) {
        self.cycles += 1;
        self.drafted += drafted;
        self.accepted += accepted;
        self.draft_s += draft.as_secs_f64();
        self.verify_s += verify.as_secs_f64();
        self.other_s += other.as_secs_f64();
    }

    /// These statistics followed by those of the same answer's continuation (`later`: the rest of its tokens,
    /// decoded on another route or in batched steps): counts and times add up; the prompt's figures stay this
    /// part's (the time to first token too, unless this part emitted nothing); the route is this part's unless
    /// this part ran AR (the drafts counted are then the continuation's route's); the stop reason is the
    /// continuation's.
    pub fn then(mut self, later: &GenerationStats) -> Self {
        if self.route == "ar" {
            self.route = later.route;
        }
        if self.completion_tokens == 0 {
            self.ttft_s = later.ttft_s;
        }
        self.completion_tokens += later.completion_tokens;
        self.decode_s += later.decode_s;
        self.stop = later.stop;
        self.cycles += later.cycles;
        self.drafted += later.drafted;
        self.accepted += later.accepted;
        self.draft_s += later.draft_s;
        self.verify_s += later.verify_s;
        self.other_s += later.other_s;
        self.store_s += later.store_s;
        self
    }

    /// Completion tokens after the first, per second of decode time.
    pub fn decode_tok_s(&self) -> f64 {
        if self.completion_tokens > 1 && self.decode_s > 0.0 {
            (self.completion_tokens - 1) as f64 / self.decode_s
        } else {
            0.0
        }
    }

    /// Tokens produced per verify forward (accepted drafts plus the target's own token); 1.0 for AR.
    pub fn tokens_per_cycle(&self) -> f64 {
        if self.cycles == 0 {
            0.0
        } else {
            (self.cycles + self.accepted) as f64 / self.cycles as f64
        }
    }

    /// One line for logs and `verity run`.
    pub fn summary(&self) -> String {
        format!(
            "route {}: {} prompt tokens ({} restored), {} completion tokens; ttft {:.3} s; {:.1} tok/s; {} cycles, \
             {:.2} tokens/cycle, {}/{} drafts accepted; draft {:.3} s, verify {:.3} s, other {:.3} s; stop: {:?}",
            self.route,
            self.prompt_tokens,
            self.restored_tokens,
            self.completion_tokens,
            self.ttft_s,
            self.decode_tok_s(),
            self.cycles,
            self.tokens_per_cycle(),
            self.accepted,
            self.drafted,
            self.draft_s,
            self.verify_s,
            self.other_s,
            self.stop
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part(route: &'static str, drafted: usize, accepted: usize) -> GenerationStats {
        GenerationStats {
            completion_tokens: 10,
            drafted,
            accepted,
            ..GenerationStats::new(route)
        }
    }

    /// An answer decoded in AR batched steps and then alone on the MTP route is reported as the MTP route's,
    /// whose drafts it counts; one decoded on MTP first keeps that route whatever follows.
    #[test]
    fn a_continued_answer_reports_the_route_that_drafted() {
        let s = part("ar", 0, 0).then(&part("mtp", 8, 5));
        assert_eq!(
            (s.route, s.drafted, s.accepted, s.completion_tokens),
            ("mtp", 8, 5, 20)
        );
        let s = part("mtp", 8, 5).then(&part("ar", 0, 0));
        assert_eq!((s.route, s.drafted), ("mtp", 8));
        let s = part("copy", 4, 2).then(&part("mtp", 8, 5));
        assert_eq!((s.route, s.drafted), ("copy", 12));
    }
}
