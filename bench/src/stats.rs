//! Small statistics and process measurements.

use std::time::Duration;

/// The value at quantile `q` (0..=1) of `v` (sorted in place).
pub fn quantile(v: &mut [Duration], q: f64) -> Duration {
    if v.is_empty() {
        return Duration::ZERO;
    }
    v.sort_unstable();
    v[((v.len() - 1) as f64 * q).round() as usize]
}

/// Median, minimum and maximum of repeated measurements.
pub fn spread(v: &[f64]) -> (f64, f64, f64) {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let median = if s.is_empty() { 0.0 } else { s[s.len() / 2] };
    (
        median,
        s.first().copied().unwrap_or(0.0),
        s.last().copied().unwrap_or(0.0),
    )
}

pub fn fmt_spread(v: &[f64], unit: &str) -> String {
    let (m, lo, hi) = spread(v);
    if v.len() > 1 {
        format!("{m:.0} {unit} ({lo:.0}–{hi:.0})")
    } else {
        format!("{m:.0} {unit}")
    }
}

pub fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

/// CPU seconds (user + system) this process has used so far.
pub fn process_cpu() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name, which is in parentheses and may contain spaces.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|s| s.parse::<f64>().ok()).unwrap_or(0.0);
    // utime and stime are fields 14 and 15 of the file, 12 and 13 after the name.
    (ticks(11) + ticks(12)) / clock_ticks()
}

fn clock_ticks() -> f64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100.0)
}

/// Resident memory of this process, in bytes.
pub fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    pages * 4096
}
