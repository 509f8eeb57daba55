//! A volume's counters, added to by every request: striped so threads on different stripes do
//! not write the same cache line (a counter every hit increments is otherwise one line that
//! bounces between CPUs). Reads sum the stripes; a sum read while requests run is as of some
//! moment during the read, as a relaxed counter always was.

use crate::sync::atomic::{AtomicU64, Ordering};
use crate::touches::thread_index;

const STRIPES: usize = 8;

/// One stripe's counters, on cache lines of their own.
#[repr(align(64))]
struct Stripe<const N: usize>([AtomicU64; N]);

pub(crate) struct StripedCounters<const N: usize> {
    stripes: Box<[Stripe<N>; STRIPES]>,
}

impl<const N: usize> StripedCounters<N> {
    /// Counters starting at `initial` (kept in the first stripe).
    pub fn new(initial: [u64; N]) -> Self {
        let stripes = std::array::from_fn(|i| {
            Stripe(std::array::from_fn(|c| {
                AtomicU64::new(if i == 0 { initial[c] } else { 0 })
            }))
        });
        StripedCounters {
            stripes: Box::new(stripes),
        }
    }

    pub fn add(&self, counter: usize, n: u64) {
        self.stripes[thread_index() % STRIPES].0[counter].fetch_add(n, Ordering::Relaxed);
    }

    pub fn total(&self, counter: usize) -> u64 {
        self.stripes
            .iter()
            .map(|s| s.0[counter].load(Ordering::Relaxed))
            .fold(0, u64::wrapping_add)
    }

    pub fn totals(&self) -> [u64; N] {
        std::array::from_fn(|c| self.total(c))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn totals_add_every_thread_and_the_initial_values() {
        let c = std::sync::Arc::new(StripedCounters::<3>::new([5, 0, 7]));
        let threads: Vec<_> = (0..12)
            .map(|_| {
                let c = c.clone();
                std::thread::spawn(move || {
                    for _ in 0..1000 {
                        c.add(1, 2);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("thread");
        }
        assert_eq!(c.totals(), [5, 24_000, 7]);
    }
}
