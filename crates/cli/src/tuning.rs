//! The cache settings of serve's config file (replacement policy, and per volume admission
//! and sequential cutoff), written into the superblock when `serve` starts: see
//! `config.rs` for the keys and docs/operations.md for choosing them.

use std::collections::BTreeMap;

use anyhow::{anyhow, bail, Result};
use ssdcache_engine::admission::Admission;
use ssdcache_format::Superblock;

use crate::config::{FileConfig, VolumeConfig};
use crate::size::human;

/// The cache settings of a config file: what `serve` writes into the superblock.
#[derive(Debug, Default, Clone)]
pub struct CacheTuning {
    pub policy: Option<String>,
    pub volumes: BTreeMap<String, VolumeConfig>,
}

impl CacheTuning {
    /// A volume's own dirty limit from `[volume.NAME] dirty_limit`, as a share (0 to 1).
    pub fn volume_dirty_limit(&self, name: &str) -> Option<f64> {
        self.volume_share(name, |v| v.dirty_limit)
    }

    /// A volume's cap on the cache it holds from `[volume.NAME] occupancy_limit`, as a share
    /// (0 to 1).
    pub fn volume_occupancy_limit(&self, name: &str) -> Option<f64> {
        self.volume_share(name, |v| v.occupancy_limit)
    }

    /// A percent key of `[volume.NAME]`, as a share.
    fn volume_share(&self, name: &str, key: fn(&VolumeConfig) -> Option<f64>) -> Option<f64> {
        self.volumes
            .get(name)
            .and_then(key)
            .map(|percent| percent / 100.0)
    }

    /// Sets the superblock's policy, admission and cutoffs as the file says; returns what
    /// changed, for the log. Refuses volume names the cache does not have and values that do
    /// not parse or are out of range (the limits too), naming the key; a refused file leaves
    /// `sb` as it was.
    pub fn apply(&self, sb: &mut Superblock) -> Result<Vec<String>> {
        let mut tuned = sb.clone();
        let changes = self.apply_to(&mut tuned)?;
        *sb = tuned;
        Ok(changes)
    }

    fn apply_to(&self, sb: &mut Superblock) -> Result<Vec<String>> {
        for name in self.volumes.keys() {
            if sb.volume_by_name(name).is_none() {
                let known: Vec<&str> = sb.volumes.iter().map(|v| v.name.as_str()).collect();
                bail!(
                    "config file: [volume.{name}]: this cache has no volume named {name:?} (its \
                     volumes: {}; a volume's name is the one given to `ssdcache create --name`)",
                    known.join(", ")
                );
            }
            if let Some(p) = self.volumes[name].dirty_limit {
                if !(0.0..=100.0).contains(&p) {
                    bail!(
                        "config file: [volume.{name}] dirty_limit = {p}: a percent of the \
                         cache's lines, 0 to 100"
                    );
                }
            }
            if let Some(p) = self.volumes[name].occupancy_limit {
                if !(p > 0.0 && p <= 100.0) {
                    bail!(
                        "config file: [volume.{name}] occupancy_limit = {p}: a percent of the \
                         cache's lines above 0, up to 100 (to cache nothing for a volume, give \
                         it mode pass-through)"
                    );
                }
            }
        }
        let mut changes = Vec::new();
        if let Some(id) = self.cache_policy(sb.volumes.len())? {
            let was = sb.volumes.first().map_or(id, |v| v.policy);
            if was != id {
                changes.push(format!(
                    "replacement policy {} (was {})",
                    policy_name(id),
                    policy_name(was)
                ));
            }
            // Every slot records it, so the first volume's (the one read at open) is right.
            for v in &mut sb.volumes {
                v.policy = id;
            }
        }
        for v in &mut sb.volumes {
            let Some(c) = self.volumes.get(&v.name) else {
                continue;
            };
            if let Some(text) = &c.admission {
                let admission: Admission = text
                    .parse()
                    .map_err(|e| anyhow!("config file: [volume.{}] admission: {e}", v.name))?;
                if admission.to_disk() != v.admission {
                    let was = Admission::from_disk(v.admission).map_or_else(
                        |_| format!("unknown code {}", v.admission),
                        |a| a.to_string(),
                    );
                    changes.push(format!(
                        "volume '{}': admission {admission} (was {was})",
                        v.name
                    ));
                    v.admission = admission.to_disk();
                }
            }
            if let Some(size) = &c.sequential_cutoff {
                let cutoff = size.bytes(&format!("[volume.{}] sequential_cutoff", v.name))?;
                if cutoff != v.sequential_cutoff {
                    changes.push(format!(
                        "volume '{}': sequential cutoff {} (was {})",
                        v.name,
                        cutoff_text(cutoff),
                        cutoff_text(v.sequential_cutoff)
                    ));
                    v.sequential_cutoff = cutoff;
                }
            }
        }
        Ok(changes)
    }

    /// The policy id the file asks for, if any: the top-level key, or a volume's key on a
    /// cache of one volume; two different ones are refused.
    fn cache_policy(&self, volumes: usize) -> Result<Option<u32>> {
        let parse = |key: &str, name: &str| {
            crate::create::parse_policy(name).map_err(|e| anyhow!("config file: {key}: {e}"))
        };
        let mut chosen = match &self.policy {
            Some(p) => Some(("the top-level policy".to_owned(), p, parse("policy", p)?)),
            None => None,
        };
        for (name, c) in &self.volumes {
            let Some(p) = &c.policy else {
                continue;
            };
            let key = format!("[volume.{name}] policy");
            let id = parse(&key, p)?;
            if volumes > 1 {
                bail!(
                    "config file: {key}: the replacement policy is one per cache, not per volume \
                     (the volumes of a cache share one pool of cache lines, evicted in one \
                     order), and this cache has {volumes} volumes; set `policy = \"{p}\"` at the \
                     top level of the file instead"
                );
            }
            if let Some((other_key, other, other_id)) = &chosen {
                if *other_id != id {
                    bail!(
                        "config file: {other_key} ({other}) and {key} ({p}) differ; the \
                         replacement policy is one per cache: set it once, at the top level"
                    );
                }
            }
            chosen = Some((key, p, id));
        }
        Ok(chosen.map(|(_, _, id)| id))
    }
}

fn policy_name(id: u32) -> String {
    ssdcache_engine::policy::NAMES
        .get(id as usize)
        .map_or_else(|| format!("unknown ({id})"), |n| (*n).to_owned())
}

fn cutoff_text(bytes: u64) -> String {
    if bytes == 0 {
        "off".to_owned()
    } else {
        human(bytes)
    }
}

impl From<&FileConfig> for CacheTuning {
    fn from(file: &FileConfig) -> CacheTuning {
        CacheTuning {
            policy: file.policy.clone(),
            volumes: file.volume.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn superblock(names: &[&str]) -> Superblock {
        use ssdcache_format::{BackingIdentity, BackingKind, CacheMode, VolumeSlot};
        let layout = ssdcache_format::Layout::compute(64 << 20, 65536).expect("layout");
        Superblock {
            version: ssdcache_format::FORMAT_VERSION,
            sequence: 1,
            cache_uuid: [0; 16],
            layout,
            state: ssdcache_format::CacheState::Clean,
            checkpoint_seq: 0,
            created_unix: 0,
            updated_unix: 0,
            unclean_starts: 0,
            journal_generation: 1,
            journal_start_seq: 1,
            journal_start_block: 0,
            cache_bytes_written: 0,
            ssd_tbw_bytes: 0,
            volumes: names
                .iter()
                .enumerate()
                .map(|(i, name)| VolumeSlot {
                    id: i as u16,
                    uuid: [0; 16],
                    name: (*name).to_owned(),
                    mode: CacheMode::WriteThrough,
                    read_only: false,
                    backing: BackingIdentity {
                        kind: BackingKind::File,
                        size: 1 << 30,
                        path: "/b".into(),
                        stable_id: "file:1:1".into(),
                        st_dev: 1,
                        st_ino: 1,
                        st_rdev: 0,
                        btime_ns: 0,
                    },
                    policy: 0,
                    admission: 0,
                    sequential_cutoff: 4 << 20,
                    counters: Default::default(),
                    dirty_lines: 0,
                    dirty_bytes: 0,
                })
                .collect(),
        }
    }

    fn tuning(text: &str) -> CacheTuning {
        toml::from_str::<FileConfig>(text)
            .map(|f| CacheTuning::from(&f))
            .expect("config parses")
    }

    #[test]
    fn volume_settings_are_written_into_the_superblock() {
        let mut sb = superblock(&["sdb"]);
        let changes = tuning(
            r#"
            policy = "arc"
            [volume.sdb]
            admission = "2-hit"
            sequential_cutoff = "8MiB"
            "#,
        )
        .apply(&mut sb)
        .expect("apply");
        let v = &sb.volumes[0];
        assert_eq!(
            (v.policy, v.admission, v.sequential_cutoff),
            (3, 2, 8 << 20)
        );
        assert_eq!(changes.len(), 3, "{changes:?}");
        assert!(
            changes[1].contains("admission 2-hit (was always)"),
            "{changes:?}"
        );
        // Applying the same file again changes nothing; a byte count and 0 (off) are sizes too.
        let again = tuning("policy = \"arc\"\n[volume.sdb]\nadmission = \"2-hit\"")
            .apply(&mut sb)
            .expect("apply");
        assert!(again.is_empty(), "{again:?}");
        tuning("[volume.sdb]\nsequential_cutoff = 0\npolicy = \"lirs\"")
            .apply(&mut sb)
            .expect("apply");
        assert_eq!(
            (sb.volumes[0].sequential_cutoff, sb.volumes[0].policy),
            (0, 6)
        );
    }

    #[test]
    fn wrong_volume_names_and_values_are_refused_with_the_key() {
        let err = |sb: &mut Superblock, text: &str| {
            format!("{:#}", tuning(text).apply(sb).expect_err(text))
        };
        let mut sb = superblock(&["sdb", "sdc"]);
        let e = err(&mut sb, "[volume.sdx]\nadmission = \"2-hit\"");
        assert!(e.contains("sdx") && e.contains("sdb, sdc"), "{e}");
        let e = err(&mut sb, "[volume.sdc]\nadmission = \"sometimes\"");
        assert!(
            e.contains("[volume.sdc] admission") && e.contains("N-hit"),
            "{e}"
        );
        let e = err(&mut sb, "[volume.sdc]\nsequential_cutoff = \"4 parsecs\"");
        assert!(e.contains("[volume.sdc] sequential_cutoff"), "{e}");
        for bad in ["0", "-5", "101"] {
            let e = err(&mut sb, &format!("[volume.sdc]\noccupancy_limit = {bad}"));
            assert!(e.contains("[volume.sdc] occupancy_limit"), "{e}");
        }
        let e = err(&mut sb, "[volume.sdb]\ndirty_limit = 120");
        assert!(e.contains("[volume.sdb] dirty_limit"), "{e}");
        let e = err(&mut sb, "policy = \"mru\"");
        assert!(e.contains("policy") && e.contains("lru"), "{e}");
        // Policy per volume: one pool of lines, so only on a cache of one volume.
        let e = err(&mut sb, "[volume.sdc]\npolicy = \"arc\"");
        assert!(
            e.contains("one per cache") && e.contains("top level"),
            "{e}"
        );
        let mut one = superblock(&["sdb"]);
        let e = err(&mut one, "policy = \"lru\"\n[volume.sdb]\npolicy = \"arc\"");
        assert!(e.contains("differ"), "{e}");
        assert_eq!(
            sb,
            superblock(&["sdb", "sdc"]),
            "a refused file changes nothing"
        );
    }
}
