//! The synthetic traces of `bench/libcachesim/synthetic` (its docstring describes them),
//! generated the same way request for request, so that `bench/libcachesim/synthetic.csv`
//! (libCacheSim's miss ratios on them) is a reference for them; and writers of requests in
//! every trace format. The generator uses integers only: Python and Rust agree bit for bit.

use std::fmt::Write as _;
use std::path::PathBuf;

use ssdcache_sim::trace::Format;

use super::samples::{oracle_general, vscsi_v1};

const SECTORS_PER_BLOCK: u64 = 8;
const SECTOR: u64 = 512;

/// splitmix64, as `SplitMix64` in bench/libcachesim/synthetic.
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// One request in 512-byte sectors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SectorRequest {
    pub start: u64,
    pub sectors: u64,
    pub write: bool,
}

impl SectorRequest {
    fn read(start: u64, sectors: u64) -> Self {
        Self {
            start,
            sectors,
            write: false,
        }
    }

    pub fn offset(&self) -> u64 {
        self.start * SECTOR
    }

    pub fn len(&self) -> u64 {
        self.sectors * SECTOR
    }
}

/// One synthetic trace: its file name in the reference csv (`synthetic/<file>`), the format it
/// is written in there, and its requests.
pub struct Synthetic {
    pub file: &'static str,
    pub format: Format,
    pub requests: Vec<SectorRequest>,
}

impl Synthetic {
    /// The name of its rows in synthetic.csv.
    pub fn reference_name(&self) -> String {
        format!("synthetic/{}", self.file)
    }

    /// Writes it in its own format into `dir`.
    pub fn write(&self, dir: &tempfile::TempDir) -> PathBuf {
        super::write_file(dir, self.file, &encode(self.format, &self.requests))
    }
}

/// Every synthetic trace, in the order of synthetic.csv.
pub fn all() -> Vec<Synthetic> {
    vec![
        Synthetic {
            file: "skewed.lis",
            format: Format::Arc,
            requests: skewed(),
        },
        Synthetic {
            file: "hotscan.lis",
            format: Format::Arc,
            requests: hotscan(),
        },
        Synthetic {
            file: "loop.lis",
            format: Format::Arc,
            requests: looping(),
        },
        Synthetic {
            file: "phases.csv",
            format: Format::VscsiCsv,
            requests: phases(),
        },
    ]
}

/// The synthetic trace written as `file`.
pub fn named(file: &str) -> Synthetic {
    all()
        .into_iter()
        .find(|trace| trace.file == file)
        .unwrap_or_else(|| panic!("no synthetic trace {file}"))
}

fn skewed_block(rng: &mut SplitMix64, n: u64) -> u64 {
    rng.below(n) * rng.below(n) / n
}

fn skewed() -> Vec<SectorRequest> {
    let (mut rng, n) = (SplitMix64::new(1), 262_144);
    (0..200_000)
        .map(|_| {
            let block = skewed_block(&mut rng, n);
            let start = block * SECTORS_PER_BLOCK + rng.below(SECTORS_PER_BLOCK);
            SectorRequest::read(start, 1 + rng.below(32))
        })
        .collect()
}

fn hotscan() -> Vec<SectorRequest> {
    let (mut rng, hot) = (SplitMix64::new(2), 4096);
    let mut out = Vec::new();
    let mut next_scan_block = hot;
    for _ in 0..12 {
        for _ in 0..10_000 {
            out.push(SectorRequest::read(
                rng.below(hot) * SECTORS_PER_BLOCK,
                SECTORS_PER_BLOCK,
            ));
        }
        for block in (next_scan_block..next_scan_block + 3000).step_by(8) {
            out.push(SectorRequest::read(block * SECTORS_PER_BLOCK, 64));
        }
        next_scan_block += 3000;
    }
    out
}

fn looping() -> Vec<SectorRequest> {
    let (mut rng, length) = (SplitMix64::new(3), 5000);
    (0..40 * length)
        .map(|i| {
            let block = if i % 50 == 49 {
                length + rng.below(20_000)
            } else {
                i % length
            };
            SectorRequest::read(block * SECTORS_PER_BLOCK, SECTORS_PER_BLOCK)
        })
        .collect()
}

fn phases() -> Vec<SectorRequest> {
    let mut rng = SplitMix64::new(4);
    let mut out = Vec::new();
    for phase in 0..8 {
        let base = phase * 3000;
        for _ in 0..25_000 {
            let block = base + skewed_block(&mut rng, 12_000);
            let sectors = SECTORS_PER_BLOCK * (1 + rng.below(8));
            let write = rng.below(100) < 55;
            out.push(SectorRequest {
                start: block * SECTORS_PER_BLOCK,
                sectors,
                write,
            });
        }
    }
    out
}

/// `requests` as a file of `format`, time advancing 10 ms a request (whole seconds in the
/// vscsi csv, as libCacheSim writes it). Formats that cannot carry something keep what they
/// can: `arc`, `oracle-general`, `sector-list` and `lirs` are reads; `sector-list` keeps each
/// request's first sector, `lirs` one line per 4 KiB block the request touches.
pub fn encode(format: Format, requests: &[SectorRequest]) -> Vec<u8> {
    let mut text = String::new();
    let ms = |i: usize| i as u64 * 10;
    let rw = |r: &SectorRequest, read: &'static str, write: &'static str| {
        if r.write {
            write
        } else {
            read
        }
    };
    match format {
        Format::Vscsi => {
            let records: Vec<(u16, u64, u32, u64)> = requests
                .iter()
                .enumerate()
                .map(|(i, r)| {
                    let cmd = if r.write { 0x2a } else { 0x28 };
                    (cmd, r.start, r.len() as u32, ms(i) * 1000)
                })
                .collect();
            return vscsi_v1(&records);
        }
        Format::OracleGeneral => {
            let records: Vec<(u32, u64, u32, i64)> = requests
                .iter()
                .enumerate()
                .map(|(i, r)| (ms(i) as u32, r.start, r.len() as u32, -1))
                .collect();
            return oracle_general(&records);
        }
        Format::Systor => text.push_str("Timestamp,Response,IOType,LUN,Offset,Size\n"),
        Format::VscsiCsv => text.push_str("version,time,op,size,lbn\n"),
        Format::FioIolog => text.push_str("fio version 3 iolog\n0 /dev/sdb add\n"),
        Format::Ssdcache => {
            text.push_str("# ssdcache-trace v1\n# time_us,volume,op,offset,length\n")
        }
        _ => {}
    }
    for (i, r) in requests.iter().enumerate() {
        let (t, start, sectors, offset, len) = (ms(i), r.start, r.sectors, r.offset(), r.len());
        let line = match format {
            Format::Arc => format!("{start} {sectors} 0 {i}"),
            Format::VscsiCsv => format!("1,{},{},{len},{start}", i / 100, rw(r, "28", "2a")),
            Format::Disksim => format!("{} 0 {start} {sectors} {}", t * 1_000_000, rw(r, "1", "0")),
            Format::Msr => format!(
                "{},hm,0,{},{offset},{len},100",
                t * 10_000,
                rw(r, "Read", "Write")
            ),
            Format::Systor => format!(
                "{}.000,0.001,{},0,{offset},{len}",
                1000 + t,
                rw(r, "R", "W")
            ),
            Format::SniaTencent => format!(
                "{},{start},{sectors},{},1058",
                1_538_323_200 + t / 1000,
                rw(r, "0", "1")
            ),
            Format::Blkparse => format!(
                "  8,0    0 {:8} {:5}.{:09}   697  Q   {} {start} + {sectors} [fio]",
                i + 1,
                t / 1000,
                (t % 1000) * 1_000_000,
                rw(r, "R", "W")
            ),
            Format::FioIolog => format!(
                "{} /dev/sdb {} {offset} {len}",
                t * 1000,
                rw(r, "read", "write")
            ),
            Format::Ssdcache => format!("{},sdb,{},{offset},{len}", t * 1000, rw(r, "R", "W")),
            Format::SectorList => start.to_string(),
            Format::Lirs => {
                let blocks = offset / 4096..=(offset + len - 1) / 4096;
                blocks.map(|b| b.to_string()).collect::<Vec<_>>().join("\n")
            }
            Format::Vscsi | Format::OracleGeneral | Format::Auto => {
                unreachable!("handled above")
            }
        };
        let _ = writeln!(text, "{line}");
    }
    text.into_bytes()
}
