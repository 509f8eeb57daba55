//! The replies of one connection on their way to the socket (docs/design.md §6, "Replies").
//!
//! Workers queue each reply and go on; one sender thread per connection takes them in order
//! and writes them. So a client that sends many requests before it reads any reply never
//! stops the connection from reading its requests: the workers never block on the socket,
//! and the requests go on being read while their replies wait, up to the connection's
//! request memory (a READ's reply holds its buffer until it is sent) and [`Outbox`]'s own
//! bound on the number of replies waiting.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, PoisonError};

use crate::server::lock;

/// Replies an empty outbox keeps room for; a larger queue is given back once drained.
const SHRINK_ABOVE: usize = 1024;

/// A bounded queue of replies with one consumer (the sender) and many producers (workers).
pub(crate) struct Outbox<T> {
    state: Mutex<State<T>>,
    /// Signalled when a reply is queued, or no more will be.
    ready: Condvar,
    /// Signalled when the sender took replies, or failed.
    room: Condvar,
    capacity: usize,
}

struct State<T> {
    waiting: VecDeque<T>,
    /// Every producer is done: the sender sends what is left and stops.
    finished: bool,
    /// The sender failed (the connection is over): nothing is queued any more.
    failed: bool,
}

impl<T> Outbox<T> {
    /// An outbox holding at most `capacity` replies (at least one).
    pub(crate) fn new(capacity: usize) -> Outbox<T> {
        Outbox {
            state: Mutex::new(State {
                waiting: VecDeque::new(),
                finished: false,
                failed: false,
            }),
            ready: Condvar::new(),
            room: Condvar::new(),
            capacity: capacity.max(1),
        }
    }

    /// Queues `replies` in order, waiting for room while the outbox is full (the sender makes
    /// room, or fails, within the connection's I/O timeout). False once the sender failed:
    /// the replies not queued are dropped (the connection is over).
    pub(crate) fn push_all(&self, replies: impl IntoIterator<Item = T>) -> bool {
        let mut refused = Vec::new();
        let mut state = lock(&self.state);
        for reply in replies {
            while !state.failed && state.waiting.len() >= self.capacity {
                // The sender may be waiting for what this call queued so far.
                self.ready.notify_one();
                state = self
                    .room
                    .wait(state)
                    .unwrap_or_else(PoisonError::into_inner);
            }
            if state.failed {
                refused.push(reply);
                continue;
            }
            state.waiting.push_back(reply);
        }
        let queued = !state.failed;
        drop(state);
        self.ready.notify_one();
        // Dropped outside the lock: a reply's buffer goes back to the pool.
        drop(refused);
        queued
    }

    /// Moves up to `most` replies into `into`, waiting for one; false once every producer
    /// finished (or the sender failed) and nothing is left.
    pub(crate) fn take(&self, most: usize, into: &mut Vec<T>) -> bool {
        let mut state = lock(&self.state);
        while state.waiting.is_empty() && !state.finished && !state.failed {
            state = self
                .ready
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
        }
        if state.waiting.is_empty() {
            return false;
        }
        let n = most.min(state.waiting.len());
        into.extend(state.waiting.drain(..n));
        if state.waiting.is_empty() && state.waiting.capacity() > SHRINK_ABOVE {
            // A burst's queue is not kept for the connection's whole life (review 43 F2).
            state.waiting.shrink_to(SHRINK_ABOVE);
        }
        drop(state);
        self.room.notify_all();
        true
    }

    /// Queues `replies` without waiting for room, past the bound: for the io_uring completion
    /// thread, which must never wait for the client (review 31 F3, review 43 F1). What it
    /// queues so is bounded by the ring (128 reads in flight), each holding its buffer from
    /// the connection's request memory. False once the sender failed.
    pub(crate) fn push_all_now(&self, replies: impl IntoIterator<Item = T>) -> bool {
        let mut state = lock(&self.state);
        if state.failed {
            drop(state);
            drop(replies.into_iter().collect::<Vec<_>>());
            return false;
        }
        state.waiting.extend(replies);
        drop(state);
        self.ready.notify_one();
        true
    }

    /// No producer will queue anything more: the sender stops once the outbox is empty.
    pub(crate) fn finish(&self) {
        lock(&self.state).finished = true;
        self.ready.notify_all();
    }

    /// The replies cannot be sent (the connection is over): drops those waiting, refuses the
    /// rest, and wakes every producer waiting for room.
    pub(crate) fn fail(&self) {
        let dropped = {
            let mut state = lock(&self.state);
            state.failed = true;
            std::mem::take(&mut state.waiting)
        };
        self.room.notify_all();
        self.ready.notify_all();
        drop(dropped);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn replies_leave_in_order_and_the_sender_stops_when_finished() {
        let outbox = Outbox::new(4);
        assert!(outbox.push_all([1, 2, 3]));
        outbox.finish();
        let mut got = Vec::new();
        assert!(outbox.take(2, &mut got));
        assert!(outbox.take(8, &mut got));
        assert_eq!(got, vec![1, 2, 3]);
        assert!(!outbox.take(8, &mut got));
    }

    #[test]
    fn a_full_outbox_holds_producers_until_the_sender_takes() {
        let outbox = Arc::new(Outbox::new(2));
        let producer = {
            let outbox = outbox.clone();
            std::thread::spawn(move || outbox.push_all(0..5))
        };
        std::thread::sleep(Duration::from_millis(50));
        assert!(!producer.is_finished(), "pushed past the bound");
        let mut got = Vec::new();
        while got.len() < 5 {
            assert!(outbox.take(1, &mut got));
        }
        assert!(producer.join().expect("producer"));
        assert_eq!(got, vec![0, 1, 2, 3, 4]);
    }

    #[test]
    fn a_failed_sender_releases_waiting_producers_and_refuses_replies() {
        let outbox = Arc::new(Outbox::new(1));
        assert!(outbox.push_all([1]));
        let producer = {
            let outbox = outbox.clone();
            std::thread::spawn(move || outbox.push_all([2]))
        };
        std::thread::sleep(Duration::from_millis(20));
        outbox.fail();
        assert!(!producer.join().expect("producer"));
        assert!(!outbox.push_all([3]));
        let mut got = Vec::new();
        assert!(!outbox.take(8, &mut got));
        assert!(got.is_empty());
    }
}
