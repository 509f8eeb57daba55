//! The sizing advisor's arithmetic: from simulated points of hit ratio against cache size,
//! the smallest cache that reaches a target; from the SSD writes at that size and the trace's
//! duration, the writes per day and the SSD's lifetime against its TBW rating; and the cost
//! of the hybrid (HDD capacity plus the SSD cache) against all-flash of the same capacity.

use serde::Serialize;

/// One simulated cache size.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct SizePoint {
    pub cache_bytes: u64,
    pub hit_ratio: f64,
    /// Bytes the cache device took over the whole trace.
    pub cache_bytes_written: u64,
}

/// The smallest simulated size whose hit ratio reaches `target`, or `None`. Points need not
/// be sorted.
pub fn smallest_reaching(points: &[SizePoint], target: f64) -> Option<SizePoint> {
    points
        .iter()
        .filter(|p| p.hit_ratio >= target)
        .min_by_key(|p| p.cache_bytes)
        .copied()
}

/// The two simulated sizes around where the curve crosses `target`: the largest below it
/// and the smallest reaching it. The advisor simulates between them to narrow the answer.
pub fn bracket(points: &[SizePoint], target: f64) -> Option<(u64, u64)> {
    let reach = smallest_reaching(points, target)?;
    let below = points
        .iter()
        .filter(|p| p.cache_bytes < reach.cache_bytes && p.hit_ratio < target)
        .map(|p| p.cache_bytes)
        .max()
        .unwrap_or(0);
    Some((below, reach.cache_bytes))
}

/// Sizes strictly between `low` and `high`, evenly spaced, rounded up to `unit`.
pub fn sizes_between(low: u64, high: u64, count: u64, unit: u64) -> Vec<u64> {
    assert!(unit > 0 && count > 0);
    let mut sizes: Vec<u64> = (1..=count)
        .map(|i| low + (high - low) * i / (count + 1))
        .map(|s| s.div_ceil(unit) * unit)
        .filter(|&s| s > low && s < high)
        .collect();
    sizes.dedup();
    sizes
}

/// Prices and ratings a user can override; the defaults are stated in `--help`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Economics {
    /// The SSD's rated endurance in bytes written; `None` = `tbw_per_tb_default` per TB of
    /// the recommended cache size.
    pub ssd_tbw_bytes: Option<f64>,
    pub ssd_price_per_tb: f64,
    pub hdd_price_per_tb: f64,
    /// Capacity to provision (the backing disk's size).
    pub capacity_bytes: u64,
}

/// TBW per TB of capacity assumed when the user gives none: a mainstream TLC SSD rated for
/// 0.3 drive writes per day over a 5-year warranty (0.3 × 365 × 5 ≈ 550 TBW per TB).
pub const TBW_PER_TB_DEFAULT: f64 = 550.0;
pub const TB: f64 = 1e12;

/// Common SSD capacities, in bytes: a cache partition lives on a drive of at least this size,
/// and the drive's rating and price are what count.
const SSD_SIZES: [u64; 8] = [
    250_000_000_000,
    500_000_000_000,
    1_000_000_000_000,
    2_000_000_000_000,
    4_000_000_000_000,
    8_000_000_000_000,
    16_000_000_000_000,
    32_000_000_000_000,
];

/// The smallest common SSD that holds a cache of `cache_bytes` (the cache itself when it is
/// larger than any).
pub fn ssd_to_buy(cache_bytes: u64) -> u64 {
    SSD_SIZES
        .into_iter()
        .find(|&s| s >= cache_bytes)
        .unwrap_or(cache_bytes)
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Endurance {
    pub ssd_bytes_written_per_day: f64,
    pub tbw_bytes: f64,
    pub tbw_assumed: bool,
    /// `None` when nothing is written (infinite).
    pub lifetime_years: Option<f64>,
}

/// Writes per day and lifetime of an SSD of `ssd_bytes` holding a cache that took `written`
/// bytes over `trace_seconds` of (scaled) workload.
pub fn endurance(ssd_bytes: u64, written: u64, trace_seconds: f64, econ: &Economics) -> Endurance {
    assert!(trace_seconds > 0.0, "a trace of positive duration");
    let per_day = written as f64 * 86_400.0 / trace_seconds;
    let (tbw_bytes, tbw_assumed) = match econ.ssd_tbw_bytes {
        Some(t) => (t, false),
        None => (TBW_PER_TB_DEFAULT * ssd_bytes as f64, true),
    };
    Endurance {
        ssd_bytes_written_per_day: per_day,
        tbw_bytes,
        tbw_assumed,
        lifetime_years: (per_day > 0.0).then(|| tbw_bytes / per_day / 365.0),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Cost {
    pub hybrid: f64,
    pub all_flash: f64,
    pub hybrid_per_tb: f64,
    pub all_flash_per_tb: f64,
    /// hybrid / all-flash.
    pub ratio: f64,
}

/// The hybrid buys the whole capacity in HDD plus the cache in SSD; all-flash buys the whole
/// capacity in SSD. Both per usable TB, so setups of different sizes compare.
pub fn cost(cache_bytes: u64, econ: &Economics) -> Cost {
    let capacity_tb = econ.capacity_bytes as f64 / TB;
    let hybrid =
        capacity_tb * econ.hdd_price_per_tb + cache_bytes as f64 / TB * econ.ssd_price_per_tb;
    let all_flash = capacity_tb * econ.ssd_price_per_tb;
    let per_tb = |total: f64| {
        if capacity_tb > 0.0 {
            total / capacity_tb
        } else {
            0.0
        }
    };
    Cost {
        hybrid,
        all_flash,
        hybrid_per_tb: per_tb(hybrid),
        all_flash_per_tb: per_tb(all_flash),
        ratio: if all_flash > 0.0 {
            hybrid / all_flash
        } else {
            0.0
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(gib: u64, hit: f64) -> SizePoint {
        SizePoint {
            cache_bytes: gib << 30,
            hit_ratio: hit,
            cache_bytes_written: 0,
        }
    }

    #[test]
    fn finds_the_smallest_size_reaching_the_target_and_its_bracket() {
        let pts = [point(8, 0.95), point(1, 0.5), point(4, 0.91), point(2, 0.8)];
        assert_eq!(
            smallest_reaching(&pts, 0.9).map(|p| p.cache_bytes),
            Some(4 << 30)
        );
        assert_eq!(bracket(&pts, 0.9), Some((2 << 30, 4 << 30)));
        assert_eq!(bracket(&pts, 0.3), Some((0, 1 << 30)));
        assert_eq!(smallest_reaching(&pts, 0.99), None);
        let between = sizes_between(2 << 30, 4 << 30, 3, 1 << 20);
        assert_eq!(
            between,
            vec![(2 << 30) + (512 << 20), 3 << 30, (3 << 30) + (512 << 20)]
        );
    }

    #[test]
    fn a_cache_lives_on_a_common_ssd_size() {
        assert_eq!(ssd_to_buy(1 << 30), 250_000_000_000);
        assert_eq!(ssd_to_buy(300_000_000_000), 500_000_000_000);
        assert_eq!(ssd_to_buy(40_000_000_000_000), 40_000_000_000_000);
    }

    #[test]
    fn endurance_scales_the_trace_to_a_day() {
        let econ = Economics {
            ssd_tbw_bytes: Some(600.0 * TB),
            ssd_price_per_tb: 60.0,
            hdd_price_per_tb: 15.0,
            capacity_bytes: 10_000_000_000_000,
        };
        // 1 TB written in an hour = 24 TB a day; 600 TBW lasts 25 days.
        let e = endurance(1 << 40, 1_000_000_000_000, 3600.0, &econ);
        assert!((e.ssd_bytes_written_per_day - 24.0 * TB).abs() < 1.0);
        let years = e.lifetime_years.expect("writes happen");
        assert!((years * 365.0 - 25.0).abs() < 1e-9);
        assert!(!e.tbw_assumed);
        let idle = endurance(1 << 40, 0, 3600.0, &econ);
        assert_eq!(idle.lifetime_years, None);
    }

    #[test]
    fn hybrid_cost_adds_the_cache_to_the_hdd() {
        let econ = Economics {
            ssd_tbw_bytes: None,
            ssd_price_per_tb: 60.0,
            hdd_price_per_tb: 15.0,
            capacity_bytes: 10_000_000_000_000,
        };
        let c = cost(500_000_000_000, &econ);
        assert!((c.hybrid - (150.0 + 30.0)).abs() < 1e-9);
        assert!((c.all_flash - 600.0).abs() < 1e-9);
        assert!((c.hybrid_per_tb - 18.0).abs() < 1e-9);
        assert!((c.ratio - 0.3).abs() < 1e-9);
        let e = endurance(500_000_000_000, 1, 1.0, &econ);
        assert!(e.tbw_assumed);
        assert!((e.tbw_bytes - 275.0 * TB).abs() < 1.0);
    }
}
