//! The summary table printed after a benchmark: per route and category, medians over prompts and repeats.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// One measured generation (the record format of bench/README.md).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Record {
    pub prompt_id: String,
    pub category: String,
    pub turn: usize,
    pub route: String,
    pub repeat: usize,
    pub prompt_tokens: usize,
    pub restored_tokens: usize,
    pub completion_tokens: usize,
    pub ttft_s: f64,
    pub decode_tok_s: f64,
    pub cycles: usize,
    pub accepted_per_cycle: f64,
    /// Rows the verify forwards ran: one per cycle plus every draft token (a tree's every node); 0 in records
    /// older than the field.
    #[serde(default)]
    pub verify_rows: usize,
    pub draft_s: f64,
    pub verify_s: f64,
    pub other_s: f64,
    pub text: String,
    /// `verity bench conversation` only: the prefix-cache arm (`on`/`off`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache: Option<String>,
    /// Seconds spent storing the prefix-cache checkpoint (during prefill); 0 in records older than the field.
    #[serde(default)]
    pub store_s: f64,
    /// Seconds the turn spent on its image (`bench conversation --image`): checking its bytes, and its features
    /// where a forward needed them (the tower, within `ttft_s`); 0 without one.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub image_s: f64,
}

fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

pub fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// One line of the summary: a route on a category (or on `all`), medians over its runs.
pub struct Row {
    pub route: String,
    pub category: String,
    pub runs: usize,
    pub decode_tok_s: f64,
    /// Median of per-run ratios to the `ar` run of the same prompt, turn and repeat; `None` without `ar` runs.
    pub vs_ar: Option<f64>,
    pub accepted_per_cycle: f64,
    pub ttft_s: f64,
}

/// Route × category (sorted, `all` included): median decode tok/s, median ratio to `ar` (per prompt, turn and
/// repeat), median accepted tokens per cycle, median time to first token.
pub fn rows(records: &[Record]) -> Vec<Row> {
    let mut groups: BTreeMap<(String, String), Vec<&Record>> = BTreeMap::new();
    for r in records {
        groups
            .entry((r.route.clone(), r.category.clone()))
            .or_default()
            .push(r);
        groups
            .entry((r.route.clone(), "all".into()))
            .or_default()
            .push(r);
    }
    let ar: BTreeMap<(String, usize, usize), f64> = records
        .iter()
        .filter(|r| r.route == "ar")
        .map(|r| ((r.prompt_id.clone(), r.turn, r.repeat), r.decode_tok_s))
        .collect();
    groups
        .into_iter()
        .map(|((route, category), rs)| {
            let ratios: Vec<f64> = rs
                .iter()
                .filter_map(|r| {
                    ar.get(&(r.prompt_id.clone(), r.turn, r.repeat))
                        .map(|a| r.decode_tok_s / a)
                })
                .collect();
            Row {
                route,
                category,
                runs: rs.len(),
                decode_tok_s: median(rs.iter().map(|r| r.decode_tok_s).collect()),
                vs_ar: (!ratios.is_empty()).then(|| median(ratios)),
                accepted_per_cycle: median(rs.iter().map(|r| r.accepted_per_cycle).collect()),
                ttft_s: median(rs.iter().map(|r| r.ttft_s).collect()),
            }
        })
        .collect()
}

/// Print [`rows`] as a table.
pub fn print(records: &[Record]) {
    println!(
        "{:<12} {:<12} {:>5} {:>10} {:>8} {:>9} {:>9}",
        "route", "category", "runs", "tok/s", "vs ar", "acc/cyc", "ttft s"
    );
    for row in rows(records) {
        println!(
            "{:<12} {:<12} {:>5} {:>10.1} {:>8} {:>9.2} {:>9.3}",
            row.route,
            row.category,
            row.runs,
            row.decode_tok_s,
            row.vs_ar.map_or("-".to_string(), |r| format!("{r:.2}x")),
            row.accepted_per_cycle,
            row.ttft_s,
        );
    }
}
