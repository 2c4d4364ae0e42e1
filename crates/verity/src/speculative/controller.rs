//! The speculation controller: picks the draft width `k` for each cycle by expected tokens per second.
//!
//! It learns, per request, the probability that draft position `i` is accepted given that the drafts before it
//! were (an EMA updated from every cycle), and the measured cost of a verify forward of `W` rows (an EMA per W)
//! plus the proposer's cost per drafted token. For each candidate `k` it estimates
//! `E[tokens] = 1 + Σ_{j≤k} Π_{i≤j} a_i` over `cost(k) = verify(k + 1) + k · draft_per_token` and takes the
//! best; `k = 0` is plain AR. When speculation stops paying it falls back to AR, probing again now and then so a
//! change of text (e.g. the answer starts quoting the prompt) is noticed. Inside a batched step a request's
//! rows share the forward with other requests', so there it weighs each drafted row's share of the batch's time
//! instead ([`Controller::choose_in_batch`]), and [`BatchGate`] checks the outcome: batched steps stop drafting
//! where drafting measurably lost.

/// The widest draft any proposer is offered.
pub const MAX_K: usize = 16;
/// EMA weight of a new observation.
const ALPHA: f32 = 0.25;
/// Initial acceptance belief: optimistic enough to try speculation, learned away within a few cycles.
const PRIOR: f32 = 0.6;
/// After this many AR cycles in a row, probe with a small draft.
const PROBE_EVERY: usize = 8;
/// In a batched step, a row costing more than this many tokens' worth of the batch's time stretches the probe
/// interval in proportion.
const PROBE_ROW_COST: f64 = 0.1;

#[derive(Debug, Clone)]
pub struct Controller {
    accept: [f32; MAX_K],
    /// Verifies of W = k + 1 rows.
    verify: RowCost,
    draft_s_per_token: f64,
    ar_streak: usize,
}

impl Default for Controller {
    fn default() -> Self {
        Controller {
            accept: [PRIOR; MAX_K],
            verify: RowCost::new(MAX_K + 1),
            draft_s_per_token: 0.0,
            ar_streak: 0,
        }
    }
}

/// The measured cost of a forward by its row count: an EMA per count, and between and beyond the measured
/// counts the least-squares line through them (how this machine's cost really grows per row); with one count
/// measured, extrapolated assuming weight streaming dominates (a small per-row increment), which keeps unmeasured
/// counts worth trying; with none, relative units (one row costs 1).
#[derive(Debug, Clone)]
pub struct RowCost {
    /// Indexed by rows, 1..=max.
    secs: Vec<Option<f64>>,
}

/// The per-row increment assumed, relative to a one-row forward, before two row counts are measured.
const ROW_PRIOR: f64 = 0.05;

impl RowCost {
    /// Row counts up to `max` are measured apart (more count as `max`).
    pub fn new(max: usize) -> Self {
        RowCost {
            secs: vec![None; max + 1],
        }
    }

    /// Learn a forward of `rows` rows that took `secs`.
    pub fn record(&mut self, rows: usize, secs: f64) {
        let w = rows.clamp(1, self.secs.len() - 1);
        let a = ALPHA as f64;
        self.secs[w] = Some(match self.secs[w] {
            Some(t) => t + a * (secs - t),
            None => secs,
        });
    }

    /// Seconds for a forward of `w` rows.
    pub fn cost(&self, w: usize) -> f64 {
        let w = w.clamp(1, self.secs.len() - 1);
        if let Some(t) = self.secs[w] {
            return t;
        }
        match self.line() {
            Line::None => 1.0 + ROW_PRIOR * (w as f64 - 1.0),
            Line::One(v, t) => t * (1.0 + ROW_PRIOR * (w as f64 - v)).max(0.5),
            Line::Fit { mx, my, slope } => (my + slope * (w as f64 - mx)).max(my * 0.5),
        }
    }

    /// Seconds each row past `w` adds: the line through the counts measured from `w` to twice `w` (a forward's
    /// cost per row changes with its size: many rows share each weight load better), else through all of them.
    pub fn per_row_near(&self, w: usize) -> f64 {
        match self.line_in(w, 2 * w + 1) {
            Line::Fit { slope, .. } => slope,
            _ => self.per_row(),
        }
    }

    /// The measured seconds of a forward of exactly `w` rows, if one was measured.
    pub fn measured(&self, w: usize) -> Option<f64> {
        self.secs.get(w).copied().flatten()
    }

    /// Seconds each extra row adds.
    pub fn per_row(&self) -> f64 {
        match self.line() {
            Line::None => ROW_PRIOR,
            Line::One(v, t) => t * ROW_PRIOR / (1.0 + ROW_PRIOR * (v - 1.0)),
            Line::Fit { slope, .. } => slope,
        }
    }

    fn line(&self) -> Line {
        self.line_in(1, self.secs.len())
    }

    /// The line through the counts measured in `lo..hi`.
    fn line_in(&self, lo: usize, hi: usize) -> Line {
        let measured: Vec<(f64, f64)> = (lo.max(1)..hi.min(self.secs.len()))
            .filter_map(|v| self.secs[v].map(|t| (v as f64, t)))
            .collect();
        match measured.as_slice() {
            [] => Line::None,
            [(v, t)] => Line::One(*v, *t),
            pts => {
                let n = pts.len() as f64;
                let mx = pts.iter().map(|p| p.0).sum::<f64>() / n;
                let my = pts.iter().map(|p| p.1).sum::<f64>() / n;
                let sxx: f64 = pts.iter().map(|p| (p.0 - mx).powi(2)).sum();
                let sxy: f64 = pts.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
                Line::Fit {
                    mx,
                    my,
                    slope: (sxy / sxx).max(0.0),
                }
            }
        }
    }
}

/// Whether the requests of batched steps draft at all, from what drafting measurably gave. The widths each
/// request chooses weigh modelled costs (a row's share of the step, its own drafting); this checks the outcome:
/// over a stretch of steps with drafts, the tokens each decoding request emitted, valued at what the same step
/// costs without drafts (measured), against the seconds the steps took, drafting included. Where that is below
/// one, drafting lost and the steps stop drafting, trying again after [`BATCH_RETRY_STEPS`] steps.
#[derive(Debug, Clone)]
pub struct BatchGate {
    drafting: bool,
    /// The current stretch's steps, the worth of what they emitted and the seconds they took.
    steps: usize,
    worth: f64,
    took: f64,
    /// Steps without drafts since drafting last lost.
    idle: usize,
}

/// Steps whose outcome decides whether batched steps keep drafting.
const BATCH_STRETCH: usize = 16;
/// Steps without drafts before batched steps try drafting again (a stretch of drafting that loses costs a few
/// percent of one stretch: a fraction of a percent of the steps).
pub const BATCH_RETRY_STEPS: usize = 256;

impl Default for BatchGate {
    fn default() -> Self {
        BatchGate {
            drafting: true,
            steps: 0,
            worth: 0.0,
            took: 0.0,
            idle: 0,
        }
    }
}

impl BatchGate {
    /// Whether this step's requests may draft.
    pub fn drafting(&self) -> bool {
        self.drafting
    }

    /// A step of `decoding` requests (none prefilling) that emitted `tokens` in `secs`, drafting included, where
    /// the same step without drafts takes `ar_secs` and emits `decoding` tokens.
    pub fn record(&mut self, decoding: usize, tokens: usize, secs: f64, ar_secs: f64) {
        if !self.drafting {
            self.idle += 1;
            if self.idle >= BATCH_RETRY_STEPS {
                self.idle = 0;
                self.drafting = true;
            }
            return;
        }
        self.worth += tokens as f64 / decoding.max(1) as f64 * ar_secs;
        self.took += secs;
        self.steps += 1;
        if self.steps == BATCH_STRETCH {
            self.drafting = self.worth >= self.took;
            (self.steps, self.worth, self.took) = (0, 0.0, 0.0);
        }
    }
}

/// The k in 0..=offered with the best `value(k, expected tokens of a cycle of k drafts)`; after a streak of
/// k = 0, a small probe so that a change of text is noticed.
fn best_width(
    accept: &[f32; MAX_K],
    ar_streak: &mut usize,
    offered: usize,
    probe_every: usize,
    value: impl Fn(usize, f64) -> f64,
) -> usize {
    let offered = offered.min(MAX_K);
    if offered == 0 {
        return 0;
    }
    let mut best = (0, value(0, 1.0));
    let (mut expected, mut chain) = (1.0f64, 1.0f64);
    for k in 1..=offered {
        chain *= accept[k - 1] as f64;
        expected += chain;
        let v = value(k, expected);
        if v > best.1 {
            best = (k, v);
        }
    }
    if best.0 == 0 {
        *ar_streak += 1;
        if *ar_streak >= probe_every {
            *ar_streak = 0;
            return offered.min(2);
        }
    } else {
        *ar_streak = 0;
    }
    best.0
}

enum Line {
    None,
    One(f64, f64),
    Fit { mx: f64, my: f64, slope: f64 },
}

impl Controller {
    /// The width to draft this cycle, given the most the proposer offers.
    pub fn choose(&mut self, offered: usize) -> usize {
        let (draft, verify) = (self.draft_s_per_token, &self.verify);
        // Expected tokens per second of a cycle of k drafts.
        best_width(
            &self.accept,
            &mut self.ar_streak,
            offered,
            PROBE_EVERY,
            |k, expected| expected / (verify.cost(k + 1) + k as f64 * draft),
        )
    }

    /// The width for a request drafting inside a batched step, whose rows share one forward with other
    /// requests': each drafted row costs the step `row_s` seconds, and drafting it this request's own measured
    /// seconds per draft; at the batch's `rate` tokens per second that is tokens the batch forgoes. The width
    /// with the most expected tokens net of that cost, 0 where no draft gains. Probes come the rarer the dearer
    /// a drafted row: every request of the batch probes, and on a machine where each row costs most of a token
    /// the probes alone would cost more than they find.
    pub fn choose_in_batch(&mut self, offered: usize, row_s: f64, rate: f64) -> usize {
        let cost = (row_s + self.draft_s_per_token) * rate;
        let every = (PROBE_EVERY as f64 * (cost / PROBE_ROW_COST).max(1.0)) as usize;
        best_width(
            &self.accept,
            &mut self.ar_streak,
            offered,
            every,
            |k, expected| expected - k as f64 * cost,
        )
    }

    /// Learn from a finished cycle.
    pub fn record(
        &mut self,
        drafted: usize,
        accepted: usize,
        rows: usize,
        verify_s: f64,
        draft_s: f64,
    ) {
        for i in 0..drafted.min(MAX_K) {
            if i < accepted {
                self.accept[i] += ALPHA * (1.0 - self.accept[i]);
            } else {
                self.accept[i] += ALPHA * (0.0 - self.accept[i]);
                break; // later positions were not tested
            }
        }
        self.verify.record(rows, verify_s);
        if drafted > 0 {
            let per = draft_s / drafted as f64;
            self.draft_s_per_token += ALPHA as f64 * (per - self.draft_s_per_token);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_proposer_that_is_always_right_gets_wide_drafts() {
        let mut c = Controller::default();
        for _ in 0..20 {
            let k = c.choose(8);
            // verify cost nearly flat in W: speculation pays
            c.record(k, k, k + 1, 0.010 + 0.001 * k as f64, 0.0);
        }
        assert_eq!(c.choose(8), 8);
    }

    #[test]
    fn a_proposer_that_is_always_wrong_falls_back_to_ar_and_probes() {
        let mut c = Controller::default();
        for _ in 0..20 {
            let k = c.choose(8);
            c.record(k, 0, k + 1, 0.010 + 0.002 * k as f64, 0.0);
        }
        let ks: Vec<usize> = (0..3 * PROBE_EVERY).map(|_| c.choose(8)).collect();
        let probes: Vec<usize> = ks
            .iter()
            .enumerate()
            .filter(|(_, &k)| k > 0)
            .map(|(i, _)| i)
            .collect();
        assert!(
            probes.len() >= 2,
            "probes after a streak of AR cycles: {ks:?}"
        );
        assert!(
            probes.windows(2).all(|w| w[1] - w[0] == PROBE_EVERY),
            "{ks:?}"
        );
        assert!(
            probes.iter().all(|&i| ks[i] <= 2),
            "probes are small: {ks:?}"
        );
    }

    #[test]
    fn unmeasured_widths_are_priced_by_the_measured_per_row_cost() {
        let mut c = Controller::default();
        // This machine: every extra row costs 30% of a one-row step.
        c.record(0, 0, 1, 0.010, 0.0);
        c.record(2, 1, 3, 0.016, 0.0);
        assert!(
            (c.verify.cost(6) - 0.025).abs() < 1e-9,
            "{}",
            c.verify.cost(6)
        );
        // A proposer right 35% of the time does not pay at that cost: no wide drafts.
        for i in 0..40 {
            let k = c.choose(8);
            let acc = usize::from(k > 0 && i % 3 == 0);
            c.record(k, acc, k + 1, 0.010 + 0.003 * k as f64, 0.0002 * k as f64);
        }
        let ks: Vec<usize> = (0..16).map(|_| c.choose(8)).collect();
        assert!(ks.iter().all(|&k| k <= 2), "{ks:?}");
    }

    #[test]
    fn the_cost_of_a_row_is_read_near_the_row_count_that_pays_it() {
        // A small CPU: 8- and 10-row steps cost ~1 ms a row, a 64-row prefill step much less per row.
        let mut c = RowCost::new(256);
        c.record(8, 0.0089);
        c.record(10, 0.0110);
        c.record(64, 0.0300);
        assert!(
            (c.per_row_near(8) - 0.00105).abs() < 1e-6,
            "{}",
            c.per_row_near(8)
        );
        assert!(c.per_row() < 0.0005, "{}", c.per_row());
        // Nothing measured near 40 rows: the line through every count.
        assert_eq!(c.per_row_near(40), c.per_row());
    }

    #[test]
    fn in_a_batch_a_row_must_earn_its_share_of_the_batchs_time() {
        // Rows nearly free (a GPU) at 100 tokens/s: an always-right proposer drafts as wide as offered.
        let mut c = Controller::default();
        for _ in 0..20 {
            let k = c.choose_in_batch(8, 0.0005, 100.0);
            c.record(k, k, k + 1, 0.01, 0.0);
        }
        assert_eq!(c.choose_in_batch(8, 0.0005, 100.0), 8);
        // The same rows, but each drafted token takes the request 10 ms of its own (a model drafting on a slow
        // machine): a token's worth of the batch's time, more than 60 % acceptance earns.
        let mut c = Controller::default();
        let ks: Vec<usize> = (0..100)
            .map(|i| {
                let k = c.choose_in_batch(8, 0.0005, 100.0);
                let acc = (0..k).take_while(|j| (i + j) % 5 < 3).count();
                c.record(k, acc, k + 1, 0.01, 0.01 * k as f64);
                k
            })
            .collect();
        let late = ks[50..].iter().filter(|&&k| k > 0).count();
        assert!(late <= 1, "{ks:?}");
        // A row costing about a token (a small CPU) and 40 % acceptance: no drafts but rare probes.
        let mut c = Controller::default();
        let ks: Vec<usize> = (0..200)
            .map(|i| {
                let k = c.choose_in_batch(8, 0.01, 100.0);
                let acc = usize::from(k > 0 && i % 5 < 2);
                c.record(k, acc.min(k), k + 1, 0.01, 0.0);
                k
            })
            .collect();
        let probes = ks.iter().filter(|&&k| k > 0).count();
        assert!(
            probes <= 200 / (PROBE_EVERY * 10) + 1,
            "{probes} probes: {ks:?}"
        );
        assert!(ks.iter().all(|&k| k <= 2), "{ks:?}");
    }

    #[test]
    fn batched_steps_stop_drafting_where_it_loses_and_try_again_later() {
        // 8 requests, a step of 8 ms without drafts: drafting that emits 1.2 tokens a request per step in 11 ms
        // loses; the gate closes after one stretch and opens again after the retry interval.
        let mut g = BatchGate::default();
        let mut drafted = 0;
        for _ in 0..BATCH_STRETCH + BATCH_RETRY_STEPS {
            if g.drafting() {
                drafted += 1;
                g.record(8, 10, 0.011, 0.008);
            } else {
                g.record(8, 8, 0.008, 0.008);
            }
        }
        assert_eq!(drafted, BATCH_STRETCH);
        assert!(g.drafting(), "tried again");
        // Drafting that emits 1.5 tokens a request in 10 ms wins: it stays on.
        let mut g = BatchGate::default();
        for _ in 0..10 * BATCH_STRETCH {
            assert!(g.drafting());
            g.record(8, 12, 0.010, 0.008);
        }
    }

    #[test]
    fn expensive_drafts_shrink_the_width() {
        let mut c = Controller::default();
        for _ in 0..30 {
            let k = c.choose(8);
            // 70% acceptance, but each drafted token costs as much as a verify.
            let acc = (k as f32 * 0.7) as usize;
            c.record(k, acc, k + 1, 0.010, 0.010 * k as f64);
        }
        assert!(c.choose(8) <= 2);
    }
}
