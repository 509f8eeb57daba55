//! A hard-disk model: how long a 7200 rpm drive takes to serve each request, and a device that
//! takes that long in real time. No hard drive is attached to the machines this project is
//! built and measured on; this model is what a cache is compared against.
//!
//! Service time of a request = command overhead + seek + rotational wait + transfer:
//! - seek(x) = settle + linear·x + sqrt·√x for a fraction x of the full stroke (0 for x = 0);
//! - the platter angle is tracked from the clock: a sector passes under the head once per
//!   revolution, so the wait depends on where the platter is when the seek ends;
//! - the transfer rate falls linearly from the outer edge (start of the disk) to the inner one;
//!   a track holds rate × revolution time bytes, so a transfer moves the angle exactly as far as
//!   the platter turns meanwhile;
//! - a request that starts where the previous one ended pays only its transfer time (the
//!   drive's read-ahead and write merging keep the head streaming);
//! - one actuator: one request at a time. Up to `queue_depth` waiting requests are reordered
//!   shortest-positioning-time-first (NCQ), with an age limit so none starves;
//! - an optional volatile write cache: writes complete at interface speed and are destaged
//!   later (when no read waits, when the cache is full, or on FLUSH, which waits for all).

use std::collections::VecDeque;
use std::io;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ssdcache_device::BlockDevice;

/// Parameters of the model; `Default` is a 7200 rpm 3.5" drive.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HddParams {
    pub capacity: u64,
    pub rpm: f64,
    pub seek_settle_ms: f64,
    pub seek_linear_ms: f64,
    pub seek_sqrt_ms: f64,
    /// Transfer rate at the outer edge (start of the disk), bytes per second.
    pub outer_rate: f64,
    /// Transfer rate at the inner edge (end of the disk), bytes per second.
    pub inner_rate: f64,
    pub command_overhead_ms: f64,
    /// Requests the drive reorders (NCQ); 1 serves in arrival order.
    pub queue_depth: usize,
    /// A waiting request older than this is served next, whatever its position.
    pub max_wait_ms: f64,
    /// Volatile write cache size in bytes; 0 = write-through drive.
    pub write_cache: u64,
    /// Host interface rate (bytes per second) at which writes enter the write cache.
    pub interface_rate: f64,
}

impl Default for HddParams {
    fn default() -> Self {
        HddParams {
            capacity: 4 << 40,
            rpm: 7200.0,
            seek_settle_ms: 1.0,
            seek_linear_ms: 2.5,
            seek_sqrt_ms: 12.5,
            outer_rate: 250e6,
            inner_rate: 125e6,
            command_overhead_ms: 0.1,
            queue_depth: 32,
            max_wait_ms: 1000.0,
            write_cache: 0,
            interface_rate: 550e6,
        }
    }
}

/// The mechanical state: where the head is. Times are seconds on the model's clock.
#[derive(Debug, Clone)]
pub struct HddModel {
    p: HddParams,
    head_x: f64,
    /// Byte offset just past the last transfer: a request starting here streams.
    head_end: u64,
}

impl HddModel {
    pub fn new(p: HddParams) -> HddModel {
        assert!(p.capacity > 0 && p.rpm > 0.0 && p.outer_rate > 0.0 && p.inner_rate > 0.0);
        HddModel {
            p,
            head_x: 0.0,
            head_end: u64::MAX,
        }
    }

    pub fn params(&self) -> &HddParams {
        &self.p
    }

    fn revolution(&self) -> f64 {
        60.0 / self.p.rpm
    }

    /// Radial position of a byte offset, 0 = outer edge, 1 = inner edge.
    fn position(&self, offset: u64) -> f64 {
        (offset as f64 / self.p.capacity as f64).clamp(0.0, 1.0)
    }

    /// Transfer rate at a byte offset (zoned recording: more bytes per track outside).
    pub fn rate(&self, offset: u64) -> f64 {
        let x = self.position(offset);
        self.p.outer_rate - (self.p.outer_rate - self.p.inner_rate) * x
    }

    fn angle(&self, offset: u64) -> f64 {
        let track_bytes = self.rate(offset) * self.revolution();
        (offset as f64 / track_bytes).fract()
    }

    pub fn seek_time(&self, distance: f64) -> f64 {
        if distance <= 0.0 {
            return 0.0;
        }
        (self.p.seek_settle_ms
            + self.p.seek_linear_ms * distance
            + self.p.seek_sqrt_ms * distance.sqrt())
            / 1e3
    }

    /// Time from `now` until the head is at the start of `offset`, ready to transfer.
    pub fn positioning(&self, offset: u64, now: f64) -> f64 {
        if offset == self.head_end {
            return 0.0;
        }
        let ready = self.p.command_overhead_ms / 1e3
            + self.seek_time((self.position(offset) - self.head_x).abs());
        let platter = ((now + ready) / self.revolution()).fract();
        let wait = (self.angle(offset) - platter).rem_euclid(1.0) * self.revolution();
        ready + wait
    }

    pub fn transfer_time(&self, offset: u64, len: u64) -> f64 {
        len as f64 / self.rate(offset)
    }

    /// Serves a request that the actuator starts at `now`; returns its completion time.
    pub fn service(&mut self, offset: u64, len: u64, now: f64) -> f64 {
        let done = now + self.positioning(offset, now) + self.transfer_time(offset, len);
        self.head_x = self.position(offset + len);
        self.head_end = offset + len;
        done
    }
}

/// A request waiting for the actuator.
#[derive(Debug, Clone, Copy)]
struct Pending {
    id: u64,
    offset: u64,
    len: u64,
    arrived: f64,
}

/// The queue in front of the actuator, the write cache, and the model's clock. Used in
/// simulated time by the calibration tests and in real time by [`HddDevice`].
#[derive(Debug)]
pub struct HddScheduler {
    model: HddModel,
    queue: VecDeque<Pending>,
    /// Written extents not yet on the platters (write cache).
    dirty: VecDeque<(u64, u64)>,
    dirty_bytes: u64,
    /// When the actuator finishes its current work.
    free_at: f64,
    next_id: u64,
}

impl HddScheduler {
    pub fn new(p: HddParams) -> HddScheduler {
        HddScheduler {
            model: HddModel::new(p),
            queue: VecDeque::new(),
            dirty: VecDeque::new(),
            dirty_bytes: 0,
            free_at: 0.0,
            next_id: 0,
        }
    }

    pub fn model(&self) -> &HddModel {
        &self.model
    }

    /// Adds a mechanical request (a read, or a write with no write cache) arriving at `now`.
    pub fn submit(&mut self, offset: u64, len: u64, now: f64) -> u64 {
        self.next_id += 1;
        self.queue.push_back(Pending {
            id: self.next_id,
            offset,
            len,
            arrived: now,
        });
        self.next_id
    }

    /// Takes a write into the write cache if it fits; returns its completion time, or `None`
    /// when the drive has no write cache or it is full (then the write goes to the queue).
    pub fn cache_write(&mut self, offset: u64, len: u64, now: f64) -> Option<f64> {
        let cap = self.model.p.write_cache;
        if cap == 0 || self.dirty_bytes + len > cap {
            return None;
        }
        self.dirty.push_back((offset, len));
        self.dirty_bytes += len;
        Some(
            now + self.model.p.command_overhead_ms / 1e3 + len as f64 / self.model.p.interface_rate,
        )
    }

    pub fn dirty_bytes(&self) -> u64 {
        self.dirty_bytes
    }

    pub fn free_at(&self) -> f64 {
        self.free_at
    }

    /// If the actuator is free at `now`, starts the next piece of work: the waiting request
    /// with the shortest positioning time among the first `queue_depth` (the oldest if it
    /// waited too long), or, when no request waits, a write-cache destage. Returns the id and
    /// completion time of a started request; destages run without anyone waiting for them.
    /// Idle time before `now` is first spent destaging, as a drive does.
    pub fn dispatch(&mut self, now: f64) -> Option<(u64, f64)> {
        while self.free_at <= now && self.queue.is_empty() && !self.dirty.is_empty() {
            self.destage_one(self.free_at.max(0.0));
        }
        if self.free_at > now || self.queue.is_empty() {
            return None;
        }
        let idx = self.pick(now);
        let req = self.queue.remove(idx)?;
        let done = self.model.service(req.offset, req.len, now);
        self.free_at = done;
        Some((req.id, done))
    }

    fn pick(&self, now: f64) -> usize {
        let window = self.queue.len().min(self.model.p.queue_depth.max(1));
        let oldest = &self.queue[0];
        if window == 1 || (now - oldest.arrived) * 1e3 > self.model.p.max_wait_ms {
            return 0;
        }
        (0..window)
            .min_by(|&a, &b| {
                let pa = self.model.positioning(self.queue[a].offset, now);
                let pb = self.model.positioning(self.queue[b].offset, now);
                pa.total_cmp(&pb)
            })
            .unwrap_or(0)
    }

    /// Destages the cached extent nearest in positioning time, starting at `start`.
    fn destage_one(&mut self, start: f64) {
        let best = (0..self.dirty.len()).min_by(|&a, &b| {
            let pa = self.model.positioning(self.dirty[a].0, start);
            let pb = self.model.positioning(self.dirty[b].0, start);
            pa.total_cmp(&pb)
        });
        if let Some((offset, len)) = best.and_then(|i| self.dirty.remove(i)) {
            self.free_at = self.model.service(offset, len, start);
            self.dirty_bytes -= len;
        }
    }

    /// Destages everything (FLUSH); returns when the platters hold it all.
    pub fn drain(&mut self, now: f64) -> f64 {
        let mut t = self.free_at.max(now);
        while !self.dirty.is_empty() {
            self.destage_one(t);
            t = self.free_at;
        }
        t
    }
}

/// Serves `count` random requests of `len` bytes from `offsets` with `depth` always
/// outstanding (a closed loop, as fio with iodepth), in simulated time. Returns requests per
/// second. For calibration.
pub fn simulate_closed_loop(
    p: HddParams,
    depth: usize,
    count: usize,
    len: u64,
    mut offsets: impl FnMut() -> u64,
) -> f64 {
    let mut s = HddScheduler::new(p);
    let mut now = 0.0;
    for _ in 0..depth {
        s.submit(offsets(), len, now);
    }
    for _ in 0..count {
        match s.dispatch(now) {
            Some((_, done)) => {
                now = done;
                s.submit(offsets(), len, now);
            }
            None => now = s.free_at(),
        }
    }
    count as f64 / now
}

/// A device that takes the model's time, in real time, for every request, and keeps the data
/// in an inner device (a file). Reads and writes wait in the model's queue.
pub struct HddDevice {
    inner: Arc<dyn BlockDevice>,
    state: Mutex<DeviceState>,
    turn: Condvar,
    epoch: Instant,
}

struct DeviceState {
    sched: HddScheduler,
    /// Requests the scheduler has started, with their completion times; each waiter takes its
    /// own.
    started: Vec<(u64, f64)>,
}

impl HddDevice {
    /// Wraps `inner`, which sits at the start of a modelled disk of `p.capacity` bytes
    /// (raised to the inner device's size if smaller).
    pub fn new(inner: Arc<dyn BlockDevice>, mut p: HddParams) -> HddDevice {
        p.capacity = p.capacity.max(inner.size()).max(1);
        let state = DeviceState {
            sched: HddScheduler::new(p),
            started: Vec::new(),
        };
        HddDevice {
            inner,
            state: Mutex::new(state),
            turn: Condvar::new(),
            epoch: Instant::now(),
        }
    }

    fn now(&self) -> f64 {
        self.epoch.elapsed().as_secs_f64()
    }

    fn lock(&self) -> MutexGuard<'_, DeviceState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn sleep_until(&self, t: f64) {
        let now = self.now();
        if t > now {
            std::thread::sleep(Duration::from_secs_f64(t - now));
        }
    }

    /// Waits for the actuator to serve `[offset, offset+len)`, then until it is done.
    fn mechanical(&self, offset: u64, len: u64) {
        let mut s = self.lock();
        let id = s.sched.submit(offset, len, self.now());
        let done = loop {
            if let Some(started) = s.sched.dispatch(self.now()) {
                s.started.push(started);
                self.turn.notify_all();
            }
            if let Some(at) = s.started.iter().position(|&(i, _)| i == id) {
                break s.started.swap_remove(at).1;
            }
            // Wake at the latest when the actuator frees up, to dispatch the next request.
            let wait = (s.sched.free_at() - self.now()).clamp(0.0001, 0.05);
            s = self
                .turn
                .wait_timeout(s, Duration::from_secs_f64(wait))
                .map(|(g, _)| g)
                .unwrap_or_else(|p| p.into_inner().0);
        };
        drop(s);
        self.sleep_until(done);
        self.turn.notify_all();
    }
}

impl BlockDevice for HddDevice {
    fn size(&self) -> u64 {
        self.inner.size()
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.mechanical(offset, buf.len() as u64);
        self.inner.read_at(buf, offset)
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        let cached = self
            .lock()
            .sched
            .cache_write(offset, buf.len() as u64, self.now());
        match cached {
            Some(done) => self.sleep_until(done),
            None => self.mechanical(offset, buf.len() as u64),
        }
        self.inner.write_at(buf, offset)
    }

    fn allocation(
        &self,
        offset: u64,
        len: u64,
        max_runs: usize,
    ) -> io::Result<Vec<ssdcache_device::Run>> {
        self.inner.allocation(offset, len, max_runs)
    }

    fn flush(&self) -> io::Result<()> {
        let done = self.lock().sched.drain(self.now());
        self.sleep_until(done);
        self.inner.flush()
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<bool> {
        self.inner.discard(offset, len)
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> io::Result<()> {
        self.mechanical(offset, len.min(1 << 20));
        self.inner.write_zeroes(offset, len)
    }

    fn describe(&self) -> String {
        format!("{} (HDD model)", self.inner.describe())
    }
}

#[cfg(test)]
mod tests {
    //! Calibration against the figures of a 7200 rpm drive (simulated time).
    use super::*;

    /// A small deterministic generator (xorshift64*), so the calibration needs no RNG crate.
    fn random_offsets(capacity: u64, align: u64, seed: u64) -> impl FnMut() -> u64 {
        let mut x = seed.max(1);
        move || {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            (x.wrapping_mul(0x2545_F491_4F6C_DD1D) % (capacity / align)) * align
        }
    }

    fn iops(depth: usize) -> f64 {
        let p = HddParams::default();
        simulate_closed_loop(p, depth, 20_000, 4096, random_offsets(p.capacity, 4096, 42))
    }

    #[test]
    fn random_4k_at_queue_depth_1_is_about_79_iops() {
        let r = iops(1);
        eprintln!("calibration: QD1 random 4 KiB = {r:.1} IOPS");
        assert!(
            (67.0..=91.0).contains(&r),
            "QD1 random 4 KiB: {r:.1} IOPS, want 79 ± 15%"
        );
    }

    #[test]
    fn reordering_a_queue_of_32_gives_150_to_200_iops() {
        let r = iops(32);
        eprintln!("calibration: QD32 random 4 KiB with reordering = {r:.1} IOPS");
        assert!(
            (150.0..=200.0).contains(&r),
            "QD32 random 4 KiB: {r:.1} IOPS, want 150-200"
        );
        let p = HddParams {
            queue_depth: 1,
            ..HddParams::default()
        };
        let fifo = simulate_closed_loop(p, 32, 5_000, 4096, random_offsets(p.capacity, 4096, 7));
        assert!(
            fifo < 95.0,
            "without reordering a deep queue gains nothing: {fifo:.1}"
        );
    }

    fn sequential_rate(start: u64) -> f64 {
        let p = HddParams::default();
        let mut next = start;
        let len = 1u64 << 20;
        simulate_closed_loop(p, 1, 200, len, move || {
            let o = next;
            next += len;
            o
        }) * len as f64
    }

    #[test]
    fn sequential_rate_is_250_mb_s_outside_and_about_half_inside() {
        let outer = sequential_rate(0);
        let inner_probe = sequential_rate(HddParams::default().capacity - (300 << 20));
        eprintln!(
            "calibration: sequential 1 MiB = {:.1} MB/s outer, {:.1} MB/s inner",
            outer / 1e6,
            inner_probe / 1e6
        );
        assert!((240e6..=255e6).contains(&outer), "outer {outer:.3e} B/s");
        let inner = sequential_rate(HddParams::default().capacity - (300 << 20));
        assert!((120e6..=135e6).contains(&inner), "inner {inner:.3e} B/s");
    }

    #[test]
    fn a_continuing_request_pays_only_transfer_time() {
        let mut m = HddModel::new(HddParams::default());
        let end = m.service(1 << 30, 65536, 0.0);
        let done = m.service((1 << 30) + 65536, 65536, end + 0.003);
        let transfer = m.transfer_time((1 << 30) + 65536, 65536);
        assert!((done - (end + 0.003) - transfer).abs() < 1e-12);
        // A jump elsewhere pays seek and rotation too.
        let far = m.service(3 << 40, 4096, done);
        assert!(far - done > 0.002);
    }

    #[test]
    fn write_cache_absorbs_writes_until_flush() {
        let p = HddParams {
            write_cache: 1 << 20,
            ..HddParams::default()
        };
        let mut s = HddScheduler::new(p);
        let done = s.cache_write(5 << 30, 4096, 0.0);
        assert!(
            done.is_some_and(|d| d < 0.001),
            "a cached write completes at interface speed"
        );
        assert!(
            s.cache_write(9 << 30, 2 << 20, 0.0).is_none(),
            "too big for the cache"
        );
        let flushed = s.drain(0.0);
        assert!(flushed > 0.002, "FLUSH waits for the destage");
        assert_eq!(s.dirty_bytes(), 0);
    }

    #[test]
    fn device_delays_in_real_time_and_keeps_data() -> io::Result<()> {
        let inner = Arc::new(crate::MemDevice::new("disk", 64 << 20));
        let dev = HddDevice::new(
            inner,
            HddParams {
                capacity: 64 << 20,
                ..HddParams::default()
            },
        );
        let t = Instant::now();
        dev.write_at(&[5u8; 4096], 40 << 20)?;
        let mut buf = [0u8; 4096];
        dev.read_at(&mut buf, 1 << 20)?;
        dev.read_at(&mut buf, 40 << 20)?;
        assert!(buf.iter().all(|&b| b == 5));
        assert!(
            t.elapsed() > Duration::from_millis(2),
            "mechanical time is spent"
        );
        Ok(())
    }
}
