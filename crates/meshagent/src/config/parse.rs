//! Value parsers that mirror the Go standard library functions the Istio agent
//! uses (`time.ParseDuration`, `strconv.ParseBool`, `strconv.Unquote`), so the
//! same env values and downward-API files mean the same thing here.

use std::time::Duration;

/// What a Go-style duration must look like; used in error messages.
pub(crate) const EXPECT_DURATION: &str = "a duration such as 24h, 30m or 1.5s";
/// What a Go-style boolean must look like; used in error messages.
pub(crate) const EXPECT_BOOL: &str = "a boolean (true/false, 1/0, t/f)";

/// Go's `strconv.ParseBool`: exactly these spellings and nothing else.
pub(crate) fn parse_go_bool(s: &str) -> Option<bool> {
    match s {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Some(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Some(false),
        _ => None,
    }
}

/// Go's `time.ParseDuration`, restricted to non-negative values because every
/// duration the agent reads is a timeout, interval or TTL.
///
/// Accepts `0`, and one or more `<number>[.<fraction>]<unit>` groups with
/// units `ns`, `us`, `µs`, `μs`, `ms`, `s`, `m`, `h` (e.g. `1h30m`, `1.5s`).
pub(crate) fn parse_go_duration(s: &str) -> Option<Duration> {
    let rest = s.strip_prefix('+').unwrap_or(s);
    if rest == "0" {
        return Some(Duration::ZERO);
    }
    if rest.is_empty() {
        return None;
    }
    // Go caps durations at i64::MAX nanoseconds; anything above overflows there.
    const MAX_NANOS: u128 = i64::MAX as u128;
    let mut total: u128 = 0;
    let mut rest = rest;
    while !rest.is_empty() {
        let int_len = rest.bytes().take_while(u8::is_ascii_digit).count();
        let (int_part, after_int) = rest.split_at(int_len);
        let (frac_part, after_num) = match after_int.strip_prefix('.') {
            Some(f) => {
                let n = f.bytes().take_while(u8::is_ascii_digit).count();
                f.split_at(n)
            }
            None => ("", after_int),
        };
        if int_part.is_empty() && frac_part.is_empty() {
            return None;
        }
        let unit_len = after_num
            .char_indices()
            .find(|(_, c)| c.is_ascii_digit() || *c == '.')
            .map_or(after_num.len(), |(i, _)| i);
        let (unit, next) = after_num.split_at(unit_len);
        let unit_nanos: u128 = match unit {
            "ns" => 1,
            "us" | "µs" | "μs" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            _ => return None,
        };
        let int_val: u128 = if int_part.is_empty() {
            0
        } else {
            int_part.parse().ok()?
        };
        let mut nanos = int_val.checked_mul(unit_nanos)?;
        if !frac_part.is_empty() {
            // Beyond 30 digits the fraction cannot change the nanosecond result.
            let digits = &frac_part[..frac_part.len().min(30)];
            let frac_val: u128 = digits.parse().ok()?;
            let scale = 10u128.checked_pow(u32::try_from(digits.len()).ok()?)?;
            nanos = nanos.checked_add(frac_val.checked_mul(unit_nanos)? / scale)?;
        }
        total = total.checked_add(nanos)?;
        if total > MAX_NANOS {
            return None;
        }
        rest = next;
    }
    let secs = u64::try_from(total / 1_000_000_000).ok()?;
    let sub = u32::try_from(total % 1_000_000_000).ok()?;
    Some(Duration::new(secs, sub))
}

/// Go's `time.Duration.String()` (`24h0m0s`, `1.5s`, `100ms`), so dumps show
/// durations the way Istio's docs and env values write them.
pub(crate) fn go_duration_string(d: Duration) -> String {
    let nanos = d.as_nanos();
    if nanos == 0 {
        return "0s".to_owned();
    }
    if nanos < 1_000_000_000 {
        let (unit, scale) = match nanos {
            n if n < 1_000 => ("ns", 1),
            n if n < 1_000_000 => ("µs", 1_000),
            _ => ("ms", 1_000_000),
        };
        return format!(
            "{}{unit}",
            with_fraction(nanos / scale, nanos % scale, scale)
        );
    }
    let secs = d.as_secs();
    let (h, m, s) = (secs / 3600, (secs / 60) % 60, secs % 60);
    let s = with_fraction(u128::from(s), u128::from(d.subsec_nanos()), 1_000_000_000);
    match (h, m) {
        (0, 0) => format!("{s}s"),
        (0, m) => format!("{m}m{s}s"),
        (h, m) => format!("{h}h{m}m{s}s"),
    }
}

fn with_fraction(int: u128, frac: u128, scale: u128) -> String {
    if frac == 0 {
        return int.to_string();
    }
    let width = scale.to_string().len() - 1;
    let digits = format!("{frac:0width$}");
    format!("{int}.{}", digits.trim_end_matches('0'))
}

/// Go's `strconv.Unquote` for the forms the Kubernetes downward API writes:
/// a double-quoted string with Go escapes, or a back-quoted raw string.
pub(crate) fn unquote_go(s: &str) -> Option<String> {
    if let Some(raw) = s.strip_prefix('`').and_then(|r| r.strip_suffix('`')) {
        return (!raw.contains('`')).then(|| raw.replace('\r', ""));
    }
    let inner = s.strip_prefix('"')?.strip_suffix('"')?;
    // Octal and \x escapes produce raw bytes; collect bytes and validate at the end.
    let mut bytes: Vec<u8> = Vec::with_capacity(inner.len());
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        match c {
            '"' | '\n' => return None,
            '\\' => {
                let esc = chars.next()?;
                match esc {
                    'a' => bytes.push(0x07),
                    'b' => bytes.push(0x08),
                    'f' => bytes.push(0x0c),
                    'n' => bytes.push(b'\n'),
                    'r' => bytes.push(b'\r'),
                    't' => bytes.push(b'\t'),
                    'v' => bytes.push(0x0b),
                    '\\' => bytes.push(b'\\'),
                    '"' => bytes.push(b'"'),
                    'x' => {
                        let h: String = chars.by_ref().take(2).collect();
                        bytes
                            .push(parse_radix_exact(&h, 16, 2).and_then(|v| u8::try_from(v).ok())?);
                    }
                    'u' | 'U' => {
                        let n = if esc == 'u' { 4 } else { 8 };
                        let h: String = chars.by_ref().take(n).collect();
                        let ch = char::from_u32(parse_radix_exact(&h, 16, n)?)?;
                        let mut buf = [0u8; 4];
                        bytes.extend_from_slice(ch.encode_utf8(&mut buf).as_bytes());
                    }
                    '0'..='7' => {
                        let mut o = String::from(esc);
                        o.extend(chars.by_ref().take(2));
                        bytes.push(parse_radix_exact(&o, 8, 3).and_then(|v| u8::try_from(v).ok())?);
                    }
                    _ => return None,
                }
            }
            _ => {
                let mut buf = [0u8; 4];
                bytes.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
    String::from_utf8(bytes).ok()
}

fn parse_radix_exact(s: &str, radix: u32, len: usize) -> Option<u32> {
    if s.len() != len {
        return None;
    }
    u32::from_str_radix(s, radix).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_durations() {
        let ok = [
            ("0", Duration::ZERO),
            ("300ms", Duration::from_millis(300)),
            ("1h30m", Duration::from_secs(5400)),
            ("1.5s", Duration::from_millis(1500)),
            (".5s", Duration::from_millis(500)),
            ("10us", Duration::from_micros(10)),
            ("10µs", Duration::from_micros(10)),
            ("7ns", Duration::from_nanos(7)),
            ("24h", Duration::from_secs(86400)),
            ("+2m", Duration::from_secs(120)),
            ("1h0m0.25s", Duration::from_millis(3_600_250)),
        ];
        for (input, want) in ok {
            assert_eq!(parse_go_duration(input), Some(want), "{input}");
        }
        for bad in [
            "",
            "abc",
            "5",
            "1x",
            "-1s",
            "1.s.",
            ".s",
            "s",
            "1e3s",
            "99999999999h",
        ] {
            assert_eq!(parse_go_duration(bad), None, "{bad}");
        }
    }

    #[test]
    fn go_duration_strings() {
        for (d, want) in [
            (Duration::ZERO, "0s"),
            (Duration::from_millis(100), "100ms"),
            (Duration::from_micros(1500), "1.5ms"),
            (Duration::from_nanos(7), "7ns"),
            (Duration::from_millis(1500), "1.5s"),
            (Duration::from_secs(45), "45s"),
            (Duration::from_secs(60), "1m0s"),
            (Duration::from_secs(86400), "24h0m0s"),
        ] {
            assert_eq!(go_duration_string(d), want);
        }
    }

    #[test]
    fn go_bools() {
        for t in ["1", "t", "T", "TRUE", "true", "True"] {
            assert_eq!(parse_go_bool(t), Some(true));
        }
        for f in ["0", "f", "F", "FALSE", "false", "False"] {
            assert_eq!(parse_go_bool(f), Some(false));
        }
        for bad in ["yes", "", "tRUE", "on"] {
            assert_eq!(parse_go_bool(bad), None);
        }
    }

    #[test]
    fn go_unquote() {
        assert_eq!(unquote_go(r#""a\nb\"c""#).as_deref(), Some("a\nb\"c"));
        assert_eq!(unquote_go(r#""\x41\101\u00e9""#).as_deref(), Some("AAé"));
        assert_eq!(unquote_go("`raw\\n`").as_deref(), Some("raw\\n"));
        assert_eq!(unquote_go(r#""plain""#).as_deref(), Some("plain"));
        for bad in ["noquotes", r#""unterminated"#, r#""bad\q""#, r#""a"b""#] {
            assert_eq!(unquote_go(bad), None, "{bad}");
        }
    }
}
