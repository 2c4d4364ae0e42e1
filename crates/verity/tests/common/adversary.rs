//! Adversarial proposers for the lossless tests: they know (or not) the AR answer and draft accordingly —
//! right, wrong, right then wrong, random, or trees whose kept path leaves the first-child line.

use verity::speculative::{Draft, Outcome, Proposer};

/// How an adversarial proposer drafts.
#[derive(Clone, Debug)]
pub enum Adversary {
    /// Random token ids, random widths.
    Random(u64),
    /// The AR continuation itself, at full width.
    AlwaysRight,
    /// Always a wrong token first.
    AlwaysWrong,
    /// Right for `n` tokens, then wrong.
    RightThenWrong(usize),
    /// A tree: at each depth up to three siblings, the right token among them (not always first, sometimes
    /// missing), decoys that sometimes have children of their own; nodes in breadth-first order, so the kept
    /// path leaves the first-child line and its cache slots must move.
    Tree(u64),
}

struct Scripted {
    kind: Adversary,
    /// The AR output (prompt + completion) the oracle reads from.
    oracle: Vec<u32>,
    vocab: u32,
    state: u64,
}

impl Proposer for Scripted {
    fn name(&self) -> &'static str {
        "scripted"
    }
    fn propose(&mut self, context: &[u32], k: usize) -> verity::Result<Draft> {
        let truth: Vec<u32> = self
            .oracle
            .get(context.len()..)
            .unwrap_or(&[])
            .iter()
            .take(k)
            .copied()
            .collect();
        let wrong = |t: u32| (t + 1) % self.vocab;
        let mut next = || {
            self.state = self
                .state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (self.state >> 33) as usize
        };
        if let Adversary::Tree(_) = self.kind {
            let (mut tokens, mut parents) = (Vec::new(), Vec::<usize>::new());
            let mut at = 0;
            for &right in &truth {
                let siblings = 1 + next() % 3;
                let right_at = (next() % 4 != 0).then(|| next() % siblings);
                let mut next_at = None;
                for j in 0..siblings {
                    if tokens.len() == k {
                        break;
                    }
                    let t = if Some(j) == right_at {
                        right
                    } else {
                        (right + 1 + j as u32) % self.vocab
                    };
                    parents.push(at);
                    tokens.push(t);
                    if t == right {
                        next_at = Some(tokens.len());
                    } else if next() % 3 == 0 && tokens.len() < k {
                        parents.push(tokens.len());
                        tokens.push((next() as u32) % self.vocab);
                    }
                }
                match next_at {
                    Some(row) => at = row,
                    None => break,
                }
            }
            return Draft::tree(tokens, parents);
        }
        let tokens = match self.kind {
            Adversary::Random(_) => {
                let w = 1 + next() % k.max(1);
                (0..w)
                    .map(|i| {
                        ((self.state >> (i % 32)) as u32).wrapping_mul(2654435761) % self.vocab
                    })
                    .collect()
            }
            Adversary::AlwaysRight => truth,
            Adversary::AlwaysWrong => truth.iter().map(|&t| wrong(t)).collect(),
            Adversary::RightThenWrong(n) => truth
                .iter()
                .enumerate()
                .map(|(i, &t)| if i < n { t } else { wrong(t) })
                .collect(),
            Adversary::Tree(_) => unreachable!(),
        };
        Ok(Draft::chain(tokens))
    }
    fn observe(&mut self, _outcome: &Outcome) {}
}

pub fn scripted(kind: Adversary, oracle: &[u32], vocab: usize) -> Box<dyn Proposer> {
    let state = match kind {
        Adversary::Random(s) | Adversary::Tree(s) => s,
        _ => 0,
    };
    Box::new(Scripted {
        kind,
        oracle: oracle.to_vec(),
        vocab: vocab as u32,
        state,
    })
}
