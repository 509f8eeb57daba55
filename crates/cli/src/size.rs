//! Byte sizes on the command line: "4096", "64KiB", "64K", "1.5GiB", "10GB" (powers of 1024
//! for K/M/G/T with or without "iB"; "KB"/"MB"... are powers of 1000, as disk vendors use).

pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size (try 65536, 64KiB or 1GiB)"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        other => {
            return Err(format!(
                "unknown size unit {other:?} in {s:?} (use KiB, MiB, GiB, TiB)"
            ))
        }
    };
    let bytes = value * mult as f64;
    if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 || bytes.fract() != 0.0 {
        return Err(format!("{s:?} is not a whole number of bytes"));
    }
    Ok(bytes as u64)
}

/// "64 KiB", "1.5 GiB": for people.
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 || v.fract() == 0.0 {
        format!("{v:.0} {}", UNITS[u])
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64KiB"), Ok(65536));
        assert_eq!(parse_size("64k"), Ok(65536));
        assert_eq!(parse_size("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_size("1GB"), Ok(1_000_000_000));
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_size("").is_err());
        assert!(parse_size("0.3").is_err());
        assert_eq!(human(65536), "64 KiB");
        assert_eq!(human(3 << 29), "1.5 GiB");
    }
}
