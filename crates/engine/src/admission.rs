//! Admission: which requests and missed lines may take cache space. Two mechanisms, each per
//! volume:
//!
//! - [`StreamDetector`] (`sequential_cutoff`): a sequential stream past its cutoff bypasses the
//!   cache altogether (reads and writes).
//! - [`Admission`] (`admission`): of the lines a request misses, which are cached. `always`
//!   caches every missed line; `N-hit` caches a line on its N-th miss within the memory of a
//!   bounded ghost table ([`NHitAdmission`]), so lines read once never cost an SSD write.
//!
//! Hits are never subject to admission: a line already in the cache is read and written there
//! as usual. Both types are plain data without locking so the simulator runs the same code.

mod nhit;
mod stream;

use std::fmt;
use std::str::FromStr;

pub use nhit::NHitAdmission;
pub use stream::{StreamDetector, Streams};

/// The largest N of N-hit admission. Beyond a few misses the table's memory (about one cache's
/// worth of lines) is what decides, not N.
pub const MAX_N_HIT: u32 = 16;

/// The admission of a new volume when none is given (`ssdcache create`), and the one
/// `ssdcache advise` assumes: `always`. 2-hit writes about a tenth of the bytes to the SSD but
/// costs 2 to 5 percentage points of hit ratio on the shared traces; docs/policies.md has the
/// measurements and the reasons.
pub const DEFAULT_ADMISSION: Admission = Admission::Always;

/// A volume's admission policy. Written as `always` or `N-hit` (`2-hit`, `3-hit`, … up to
/// [`MAX_N_HIT`]); stored in the volume's superblock slot (bytes 524..528) as 0 for `always`
/// and N for `N-hit`. Code 1 and codes above `MAX_N_HIT` are refused when a cache is opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Admission {
    /// Every missed line is cached.
    Always,
    /// A missed line is cached on its N-th miss (2 ≤ N ≤ [`MAX_N_HIT`]).
    NHit(u32),
}

impl Default for Admission {
    fn default() -> Admission {
        DEFAULT_ADMISSION
    }
}

/// A wrong admission name or on-disk code.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmissionError {
    #[error(
        "unknown admission {0:?}: use \"always\" or \"N-hit\" with N from 2 to {MAX_N_HIT} \
         (for example \"2-hit\")"
    )]
    UnknownName(String),
    #[error(
        "admission code {0} is not one this ssdcache knows (0 = always, 2 to {MAX_N_HIT} = N-hit): \
         the cache was configured by a newer ssdcache, or its superblock is damaged"
    )]
    UnknownCode(u32),
}

impl Admission {
    /// The value stored in the superblock.
    pub fn to_disk(self) -> u32 {
        match self {
            Admission::Always => 0,
            Admission::NHit(n) => n,
        }
    }

    /// Decodes the superblock value, refusing codes this version does not know.
    pub fn from_disk(code: u32) -> Result<Admission, AdmissionError> {
        match code {
            0 => Ok(Admission::Always),
            n if (2..=MAX_N_HIT).contains(&n) => Ok(Admission::NHit(n)),
            other => Err(AdmissionError::UnknownCode(other)),
        }
    }

    /// The admission table for a cache of `lines` lines: `None` for `always` (nothing to
    /// count), otherwise an N-hit table remembering the misses of as many lines as the cache
    /// holds.
    pub fn table(self, lines: usize) -> Option<NHitAdmission> {
        match self {
            Admission::Always => None,
            Admission::NHit(n) => Some(NHitAdmission::new(n, lines)),
        }
    }
}

impl FromStr for Admission {
    type Err = AdmissionError;

    /// Parses `always` or `N-hit` (case-insensitive).
    fn from_str(s: &str) -> Result<Admission, AdmissionError> {
        let name = s.trim().to_ascii_lowercase();
        if name == "always" {
            return Ok(Admission::Always);
        }
        name.strip_suffix("-hit")
            .and_then(|n| n.parse::<u32>().ok())
            .filter(|n| (2..=MAX_N_HIT).contains(n))
            .map(Admission::NHit)
            .ok_or_else(|| AdmissionError::UnknownName(s.to_owned()))
    }
}

impl fmt::Display for Admission {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Admission::Always => f.write_str("always"),
            Admission::NHit(n) => write!(f, "{n}-hit"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_disk_codes_round_trip() {
        for a in [Admission::Always, Admission::NHit(2), Admission::NHit(16)] {
            assert_eq!(a.to_string().parse::<Admission>(), Ok(a));
            assert_eq!(Admission::from_disk(a.to_disk()), Ok(a));
        }
        assert_eq!("2-hit".parse(), Ok(Admission::NHit(2)));
        assert_eq!(" Always ".parse(), Ok(Admission::Always));
        assert_eq!(Admission::default(), DEFAULT_ADMISSION);
        assert_eq!(Admission::Always.to_disk(), 0);
        assert_eq!(Admission::NHit(3).to_disk(), 3);
    }

    #[test]
    fn refuses_unknown_names_and_codes() {
        for bad in [
            "", "never", "1-hit", "17-hit", "-hit", "2hit", "two-hit", "2-hits",
        ] {
            let err = bad.parse::<Admission>().expect_err(bad);
            assert!(err.to_string().contains("always"), "{err}");
        }
        for code in [1, 17, u32::MAX] {
            assert_eq!(
                Admission::from_disk(code),
                Err(AdmissionError::UnknownCode(code))
            );
        }
    }

    #[test]
    fn always_needs_no_table() {
        assert!(Admission::Always.table(100).is_none());
        let mut t = Admission::NHit(2).table(100).expect("a table");
        assert!(!t.admit(1));
        assert!(t.admit(1));
    }
}
