//! The durability contract (docs/design.md §4.1) as a model: what each sector may read as,
//! live and after a power cut at any instant of a run.
//!
//! The workload logs every request it makes as events stamped with the crash clock's op count
//! at that moment (threads run one at a time under shuttle, and a device call is atomic, so an
//! event stamped `k` happened after op `k` and before op `k + 1`). The contract at a power cut
//! right after op `n` is the replay of the events stamped below `n`:
//! - a FLUSH that completed makes durable every write that completed before the FLUSH started;
//!   a FUA write that completed makes itself durable; nothing else makes anything durable;
//! - a sector may read as one of its durable candidates, or as any value a write that started
//!   after them wrote (completed or still in flight at the cut);
//! - a failed write may or may not have landed; a failed FLUSH makes nothing durable;
//! - a TRIM leaves the sector reading as any value it ever held (the device may discard).
//!
//! Sectors have one writer each (the workload gives each thread its own), so a sector's
//! writes are sequential: each completes before the next starts.

use std::collections::{BTreeMap, BTreeSet};

/// What a write left in a sector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Value {
    /// A tagged sector (tag 0: zeroes).
    Tag(u64),
    /// After a TRIM: anything the sector ever held.
    Anything,
}

/// One logged request step.
#[derive(Debug, Clone, Copy)]
pub enum Event {
    /// A write of `value` to `sector` was issued.
    Start { sector: u64, value: Value },
    /// That write returned; `fua` writes that succeed are durable.
    Done { sector: u64, ok: bool, fua: bool },
    /// A FLUSH was issued (`id` pairs it with its end).
    FlushStart { id: u64 },
    /// The FLUSH returned.
    FlushDone { id: u64, ok: bool },
}

#[derive(Debug, Clone)]
struct Write {
    value: Value,
    /// Sequence number of its `Done`, with success, once it completed.
    done: Option<(u64, bool)>,
}

#[derive(Debug, Clone)]
struct Sector {
    /// Values one of which survives for certain (initially zeroes).
    durable: Vec<Value>,
    /// Writes since, in order; the last may still be in flight.
    since: Vec<Write>,
    /// Every tag ever written (for `Anything`), zeroes included.
    ever: BTreeSet<u64>,
}

impl Default for Sector {
    fn default() -> Sector {
        Sector {
            durable: vec![Value::Tag(0)],
            since: Vec::new(),
            ever: BTreeSet::from([0]),
        }
    }
}

impl Sector {
    fn allows(&self, mut values: impl Iterator<Item = Value>, tag: u64) -> bool {
        values.any(|v| match v {
            Value::Tag(t) => t == tag,
            Value::Anything => self.ever.contains(&tag),
        })
    }

    /// After a FLUSH that started at sequence `started` completed.
    fn flushed(&mut self, started: u64) {
        let covered = self
            .since
            .iter()
            .take_while(|w| w.done.is_some_and(|(seq, _)| seq < started))
            .count();
        if covered == 0 {
            return;
        }
        let last_ok = self.since[..covered]
            .iter()
            .rposition(|w| w.done.is_some_and(|(_, ok)| ok));
        let from = match last_ok {
            Some(i) => {
                self.durable.clear();
                i
            }
            None => 0,
        };
        let newly: Vec<Value> = self.since[from..covered].iter().map(|w| w.value).collect();
        self.durable.extend(newly);
        self.since.drain(..covered);
    }
}

/// The contract of every sector a run touched.
#[derive(Debug, Clone, Default)]
pub struct Contract {
    sectors: BTreeMap<u64, Sector>,
    /// Start sequence of each FLUSH in flight.
    flushes: BTreeMap<u64, u64>,
    /// Events applied.
    seq: u64,
}

impl Contract {
    pub fn apply(&mut self, event: &Event) {
        self.seq += 1;
        let seq = self.seq;
        match *event {
            Event::Start { sector, value } => {
                let s = self.sectors.entry(sector).or_default();
                if let Value::Tag(t) = value {
                    s.ever.insert(t);
                }
                s.since.push(Write { value, done: None });
            }
            Event::Done { sector, ok, fua } => {
                let Some(s) = self.sectors.get_mut(&sector) else {
                    return;
                };
                let Some(w) = s.since.last_mut() else {
                    return;
                };
                w.done = Some((seq, ok));
                if ok && fua {
                    let value = w.value;
                    s.durable = vec![value];
                    s.since.clear();
                }
            }
            Event::FlushStart { id } => {
                self.flushes.insert(id, seq);
            }
            Event::FlushDone { id, ok } => {
                if let Some(started) = self.flushes.remove(&id) {
                    if ok {
                        for s in self.sectors.values_mut() {
                            s.flushed(started);
                        }
                    }
                }
            }
        }
    }

    /// Whether `tag` is a value `sector` may read as after a power cut now.
    pub fn allows_after_crash(&self, sector: u64, tag: u64) -> bool {
        match self.sectors.get(&sector) {
            None => tag == 0,
            Some(s) => s.allows(
                &mut s
                    .durable
                    .iter()
                    .copied()
                    .chain(s.since.iter().map(|w| w.value)),
                tag,
            ),
        }
    }

    /// Whether `tag` is a value `sector` may read as now, live, by its writer (no write of
    /// its own in flight): its last successful write, or a failed one after it.
    pub fn allows_live(&self, sector: u64, tag: u64) -> bool {
        let Some(s) = self.sectors.get(&sector) else {
            return tag == 0;
        };
        let last_ok = s
            .since
            .iter()
            .rposition(|w| w.done.is_some_and(|(_, ok)| ok));
        let mut values: Vec<Value> = match last_ok {
            Some(i) => s.since[i..].iter().map(|w| w.value).collect(),
            None => s
                .durable
                .iter()
                .copied()
                .chain(s.since.iter().map(|w| w.value))
                .collect(),
        };
        values.dedup();
        s.allows(values.into_iter(), tag)
    }

    /// What `sector` may read as after a crash, for messages.
    pub fn describe(&self, sector: u64) -> String {
        match self.sectors.get(&sector) {
            None => "never written: zeroes".into(),
            Some(s) => {
                let name = |v: &Value| match v {
                    Value::Tag(t) => format!("{t:#x}"),
                    Value::Anything => "anything it held (trimmed)".into(),
                };
                let durable: Vec<String> = s.durable.iter().map(name).collect();
                let since: Vec<String> = s
                    .since
                    .iter()
                    .map(|w| {
                        let state = match w.done {
                            None => "in flight",
                            Some((_, true)) => "completed",
                            Some((_, false)) => "failed",
                        };
                        format!("{} ({state})", name(&w.value))
                    })
                    .collect();
                format!(
                    "one of [{}] (durable), or a write since: [{}]",
                    durable.join(", "),
                    since.join(", ")
                )
            }
        }
    }

    pub fn sectors(&self) -> impl Iterator<Item = u64> + '_ {
        self.sectors.keys().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(events: &[Event]) -> Contract {
        let mut c = Contract::default();
        for e in events {
            c.apply(e);
        }
        c
    }

    fn write(sector: u64, tag: u64, ok: bool, fua: bool) -> [Event; 2] {
        [
            Event::Start {
                sector,
                value: Value::Tag(tag),
            },
            Event::Done { sector, ok, fua },
        ]
    }

    #[test]
    fn a_flush_covers_writes_completed_before_it_started() {
        let mut events = Vec::new();
        events.extend(write(1, 10, true, false));
        events.push(Event::FlushStart { id: 1 });
        events.extend(write(1, 11, true, false)); // completed during the flush: not covered
        events.push(Event::FlushDone { id: 1, ok: true });
        let c = run(&events);
        assert!(!c.allows_after_crash(1, 0));
        assert!(c.allows_after_crash(1, 10) && c.allows_after_crash(1, 11));
        assert!(c.allows_live(1, 11) && !c.allows_live(1, 10));
    }

    #[test]
    fn failed_flushes_and_writes_promise_nothing() {
        let mut events = Vec::new();
        events.extend(write(1, 10, true, false));
        events.push(Event::FlushStart { id: 1 });
        events.push(Event::FlushDone { id: 1, ok: false });
        events.extend(write(1, 11, false, false));
        let c = run(&events);
        for tag in [0, 10, 11] {
            assert!(c.allows_after_crash(1, tag), "{tag}");
        }
        assert!(c.allows_live(1, 10) && c.allows_live(1, 11) && !c.allows_live(1, 0));
        // A later flush: 10 or the failed 11, never 0.
        let mut events2 = events.clone();
        events2.push(Event::FlushStart { id: 2 });
        events2.push(Event::FlushDone { id: 2, ok: true });
        let c = run(&events2);
        assert!(!c.allows_after_crash(1, 0));
        assert!(c.allows_after_crash(1, 10) && c.allows_after_crash(1, 11));
    }

    #[test]
    fn fua_makes_its_write_durable_and_trim_allows_any_past_value() {
        let mut events = Vec::new();
        events.extend(write(1, 10, true, false));
        events.extend(write(1, 11, true, true));
        let c = run(&events);
        assert!(!c.allows_after_crash(1, 10) && c.allows_after_crash(1, 11));
        events.push(Event::Start {
            sector: 1,
            value: Value::Anything,
        });
        events.push(Event::Done {
            sector: 1,
            ok: true,
            fua: true,
        });
        let c = run(&events);
        for tag in [0, 10, 11] {
            assert!(
                c.allows_after_crash(1, tag) && c.allows_live(1, tag),
                "{tag}"
            );
        }
        assert!(!c.allows_after_crash(1, 12) && !c.allows_after_crash(2, 10));
    }

    #[test]
    fn a_write_in_flight_at_the_cut_may_have_landed() {
        let mut events = Vec::new();
        events.extend(write(1, 10, true, true));
        events.push(Event::Start {
            sector: 1,
            value: Value::Tag(11),
        });
        let c = run(&events);
        assert!(c.allows_after_crash(1, 10) && c.allows_after_crash(1, 11));
        assert!(!c.allows_after_crash(1, 0));
    }
}
