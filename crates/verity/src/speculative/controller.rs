//! The speculation controller: picks the draft width `k` for each cycle by expected tokens per second.
//!
//! It learns, per request, the probability that draft position `i` is accepted given that the drafts before it
//! were (an EMA updated from every cycle), and the measured cost of a verify forward of `W` rows (an EMA per W)
//! plus the proposer's cost per drafted token. For each candidate `k` it estimates
//! `E[tokens] = 1 + Σ_{j≤k} Π_{i≤j} a_i` over `cost(k) = verify(k + 1) + k · draft_per_token` and takes the
//! best; `k = 0` is plain AR. When speculation stops paying it falls back to AR, probing again now and then so a
//! change of text (e.g. the answer starts quoting the prompt) is noticed.

/// The widest draft any proposer is offered.
pub const MAX_K: usize = 16;
/// EMA weight of a new observation.
const ALPHA: f32 = 0.25;
/// Initial acceptance belief: optimistic enough to try speculation, learned away within a few cycles.
const PRIOR: f32 = 0.6;
/// After this many AR cycles in a row, probe with a small draft.
const PROBE_EVERY: usize = 8;

#[derive(Debug, Clone)]
pub struct Controller {
    accept: [f32; MAX_K],
    /// Indexed by rows W = k + 1, so 1..=MAX_K + 1.
    verify_s: [Option<f64>; MAX_K + 2],
    draft_s_per_token: f64,
    ar_streak: usize,
}

impl Default for Controller {
    fn default() -> Self {
        Controller {
            accept: [PRIOR; MAX_K],
            verify_s: [None; MAX_K + 2],
            draft_s_per_token: 0.0,
            ar_streak: 0,
        }
    }
}

impl Controller {
    /// Seconds for a verify of `w` rows: measured; else, once two widths are measured, the least-squares line
    /// through every measured width (how this machine's cost really grows per row); else extrapolated from the
    /// one measured width assuming weight streaming dominates (a small per-row increment), which keeps
    /// unmeasured widths worth trying.
    fn verify_cost(&self, w: usize) -> f64 {
        if let Some(t) = self.verify_s[w] {
            return t;
        }
        let measured: Vec<(f64, f64)> = (1..=MAX_K + 1)
            .filter_map(|v| self.verify_s[v].map(|t| (v as f64, t)))
            .collect();
        match measured.as_slice() {
            [] => 1.0 + 0.05 * (w as f64 - 1.0),
            [(v, t)] => t * (1.0 + 0.05 * (w as f64 - v)).max(0.5),
            pts => {
                let n = pts.len() as f64;
                let mx = pts.iter().map(|p| p.0).sum::<f64>() / n;
                let my = pts.iter().map(|p| p.1).sum::<f64>() / n;
                let sxx: f64 = pts.iter().map(|p| (p.0 - mx).powi(2)).sum();
                let sxy: f64 = pts.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
                let slope = (sxy / sxx).max(0.0);
                (my + slope * (w as f64 - mx)).max(my * 0.5)
            }
        }
    }

    /// The width to draft this cycle, given the most the proposer offers.
    pub fn choose(&mut self, offered: usize) -> usize {
        let offered = offered.min(MAX_K);
        if offered == 0 {
            return 0;
        }
        let mut best = (0, 1.0 / self.verify_cost(1));
        let (mut expected, mut chain) = (1.0f64, 1.0f64);
        for k in 1..=offered {
            chain *= self.accept[k - 1] as f64;
            expected += chain;
            let rate = expected / (self.verify_cost(k + 1) + k as f64 * self.draft_s_per_token);
            if rate > best.1 {
                best = (k, rate);
            }
        }
        if best.0 == 0 {
            self.ar_streak += 1;
            if self.ar_streak >= PROBE_EVERY {
                self.ar_streak = 0;
                return offered.min(2);
            }
        } else {
            self.ar_streak = 0;
        }
        best.0
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
        let w = rows.clamp(1, MAX_K + 1);
        let a = ALPHA as f64;
        self.verify_s[w] = Some(match self.verify_s[w] {
            Some(t) => t + a * (verify_s - t),
            None => verify_s,
        });
        if drafted > 0 {
            let per = draft_s / drafted as f64;
            self.draft_s_per_token += a * (per - self.draft_s_per_token);
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
            (c.verify_cost(6) - 0.025).abs() < 1e-9,
            "{}",
            c.verify_cost(6)
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
