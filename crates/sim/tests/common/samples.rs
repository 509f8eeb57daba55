//! Small valid traces of every format, written in tests' temporary directories.

use ssdcache_sim::trace::Format;

/// A valid trace of `format` with three request lines; the data lines are the last three.
pub fn sample(format: Format) -> Vec<u8> {
    let text: &str = match format {
        Format::Msr => concat!(
            "128166385295514663,hm,0,Write,9056014336,2048,2833\n",
            "128166385295514878,hm,0,Read,11855351808,512,2617\n",
            "128166385295515175,prxy,1,Write,5548077056,4096,2320\n",
        ),
        Format::Arc => "230027 8 0 0\n1842745 64 0 1\n216082 8 0 2\n",
        Format::Blkparse => concat!(
            "  8,0    3        1     0.000000000   697  Q   R 223490 + 8 [kjournald]\n",
            "  8,0    3        2     0.000001779   697  G   R 223490 + 8 [kjournald]\n",
            "  8,0    0        3     0.001000000  1234  Q  WS 1000 + 16 [jbd2/sda1-8]\n",
            "  8,16   1        1     0.002000000   555  Q   R 8 + 8 [dd]\n",
        ),
        Format::FioIolog => concat!(
            "fio version 3 iolog\n",
            "0 /dev/sdb add\n",
            "10 /dev/sdb read 0 4096\n",
            "25 /dev/sdb write 8192 4096\n",
            "40 /dev/sdb read 4096 512\n",
        ),
        Format::SniaTencent => concat!(
            "1538323200,4247200,128,1,1058\n",
            "1538323199,13896880,128,0,1063\n",
            "1538323201,49413280,16,0,1063\n",
        ),
        Format::Systor => concat!(
            "Timestamp,Response,IOType,LUN,Offset,Size\n",
            "1455591804.310701000,0.006475000,R,0,203468398592,32768\n",
            "1455591804.318699000,,W,1,4590576115200,4096\n",
            "1455591805.635694000,0.005881000,R,0,1698303325696,4096\n",
        ),
        Format::Disksim => concat!(
            "938513000 4 264719034 16 0\n",
            "938828000 3 197570570 16 1\n",
            "938944000 13 93230992 32 0\n",
        ),
        Format::Lirs => "2819\n85\n560\n",
        Format::SectorList => "42932745\n42932746\n40409911\n",
        Format::VscsiCsv => concat!(
            "version,time,op,size,lbn\n",
            "1,5633898,2a,512,42932745\n",
            "1,5633898,28,6656,40409911\n",
            "1,5633899,2a,4096,3345071\n",
        ),
        Format::Ssdcache => concat!(
            "# ssdcache-trace v1\n",
            "# sample_rate=0.25 sample_region=1048576\n",
            "# time_us,volume,op,offset,length\n",
            "0,sdb,R,0,4096\n",
            "12,sdb,W,1048576,65536\n",
            "30,sdc,R,8192,512\n",
        ),
        Format::Vscsi => {
            return vscsi_v1(&[
                (0x2a, 42_932_745, 512, 1000),
                (0x28, 8, 4096, 1500),
                (0x2a, 16, 8192, 2000),
            ])
        }
        Format::OracleGeneral => {
            return oracle_general(&[
                (7, 42_932_745, 512, 3),
                (7, 8, 4096, -1),
                (8, 42_932_745, 512, -1),
            ])
        }
        Format::Auto => panic!("auto is not a format of a file"),
    };
    text.as_bytes().to_vec()
}

/// vscsi version 1 records of (cmd, lbn, len, ts µs).
pub fn vscsi_v1(records: &[(u16, u64, u32, u64)]) -> Vec<u8> {
    let mut bytes = Vec::new();
    for (sequence, &(cmd, lbn, len, ts)) in records.iter().enumerate() {
        bytes.extend_from_slice(&(sequence as u32).to_le_bytes());
        bytes.extend_from_slice(&len.to_le_bytes());
        bytes.extend_from_slice(&1u32.to_le_bytes());
        bytes.extend_from_slice(&cmd.to_le_bytes());
        bytes.extend_from_slice(&0x0100u16.to_le_bytes());
        bytes.extend_from_slice(&lbn.to_le_bytes());
        bytes.extend_from_slice(&ts.to_le_bytes());
    }
    bytes
}

/// vscsi version 2 records of (cmd, lbn, len, ts µs).
pub fn vscsi_v2(records: &[(u16, u64, u32, u64)]) -> Vec<u8> {
    let mut bytes = Vec::new();
    for (sequence, &(cmd, lbn, len, ts)) in records.iter().enumerate() {
        bytes.extend_from_slice(&cmd.to_le_bytes());
        bytes.extend_from_slice(&0x0200u16.to_le_bytes());
        bytes.extend_from_slice(&(sequence as u32).to_le_bytes());
        bytes.extend_from_slice(&len.to_le_bytes());
        bytes.extend_from_slice(&1u32.to_le_bytes());
        bytes.extend_from_slice(&lbn.to_le_bytes());
        bytes.extend_from_slice(&ts.to_le_bytes());
        bytes.extend_from_slice(&77u64.to_le_bytes());
    }
    bytes
}

/// oracleGeneral records of (timestamp, obj_id, obj_size, next_access_vtime).
pub fn oracle_general(records: &[(u32, u64, u32, i64)]) -> Vec<u8> {
    let mut bytes = Vec::new();
    for &(timestamp, obj_id, obj_size, next) in records {
        bytes.extend_from_slice(&timestamp.to_le_bytes());
        bytes.extend_from_slice(&obj_id.to_le_bytes());
        bytes.extend_from_slice(&obj_size.to_le_bytes());
        bytes.extend_from_slice(&next.to_le_bytes());
    }
    bytes
}

/// Requests each sample holds.
pub const SAMPLE_REQUESTS: usize = 3;

/// Lines of each text sample (header lines included).
pub fn sample_lines(format: Format) -> usize {
    sample(format).iter().filter(|&&b| b == b'\n').count()
}
