//! Where the parts of a DNS message are on the wire, so that forwarded replies can be served
//! as the upstream encoded them (TTLs clamped or aged in place, ID and question case patched)
//! instead of being re-encoded: hickory's encoder compresses only the first 120 names of a
//! message (`COMPRESSED_NAME_LIMIT`, a guard against quadratic work), so a re-encoded answer
//! with many records is larger than the upstream's (by the length of every later owner name) and
//! can be truncated where the upstream's reply was not.
//!
//! Every read is bounds-checked; a message that does not walk cleanly gives `None`.

/// RR type OPT (RFC 6891): its TTL field holds the extended RCODE, version and flags.
const OPT: u16 = 41;
/// A name is at most 255 bytes, so at most 128 labels (each at least a length byte and one
/// character) plus a pointer: more is malformed.
const MAX_LABELS: usize = 128;

/// The layout of a message: its question section and the TTL fields of its records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// The end of the question section (it starts at 12).
    pub question_end: usize,
    /// The offset of each record's 4-byte TTL, OPT records excluded.
    pub ttls: Vec<u16>,
}

fn u16_at(msg: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_be_bytes([*msg.get(at)?, *msg.get(at + 1)?]))
}

/// The offset just past the name at `at` (labels, ending in the root label or a pointer).
fn skip_name(msg: &[u8], mut at: usize) -> Option<usize> {
    for _ in 0..=MAX_LABELS {
        let len = *msg.get(at)?;
        match len & 0xc0 {
            0 if len == 0 => return Some(at + 1),
            0 => at += 1 + usize::from(len),
            0xc0 => {
                msg.get(at + 1)?;
                return Some(at + 2);
            }
            // 0x40 and 0x80: extended and reserved label types (RFC 6891 §5): not walked.
            _ => return None,
        }
    }
    None
}

/// Walks `msg`: `None` unless every section is where its header says and the message ends
/// with its last record.
pub fn layout(msg: &[u8]) -> Option<Layout> {
    if msg.len() < 12 || msg.len() > usize::from(u16::MAX) {
        return None;
    }
    let count = |i: usize| u16_at(msg, 4 + 2 * i).map(usize::from);
    let (qd, an, ns, ar) = (count(0)?, count(1)?, count(2)?, count(3)?);
    let mut at = 12;
    for _ in 0..qd {
        at = skip_name(msg, at)? + 4;
    }
    let question_end = at;
    if question_end > msg.len() {
        return None;
    }
    let mut ttls = Vec::with_capacity(an + ns + ar);
    for _ in 0..an + ns + ar {
        at = skip_name(msg, at)?;
        let rtype = u16_at(msg, at)?;
        let rdlen = usize::from(u16_at(msg, at + 8)?);
        if rtype != OPT {
            ttls.push(u16::try_from(at + 4).ok()?);
        }
        at += 10 + rdlen;
        if at > msg.len() {
            return None;
        }
    }
    (at == msg.len()).then_some(Layout { question_end, ttls })
}

/// The raw first question (name, type, class) of a message whose question count is 1 and
/// whose name is not compressed (true of every query, and of the question section of
/// replies from common servers); `None` otherwise.
pub fn question(msg: &[u8]) -> Option<&[u8]> {
    if msg.len() < 12 || msg[4..6] != [0, 1] {
        return None;
    }
    let mut i = 12;
    loop {
        let len = *msg.get(i)? as usize;
        if len == 0 {
            i += 1;
            break;
        }
        if len & 0xc0 != 0 {
            return None;
        }
        i += 1 + len;
    }
    msg.get(12..i + 4)
}

/// RFC 2181 §8: a TTL with the most significant bit set is treated as zero.
pub fn clamp_ttl(ttl: u32) -> u32 {
    if ttl > i32::MAX as u32 { 0 } else { ttl }
}

/// Rewrites each TTL of `l` in `msg` as `f(ttl)`.
pub fn map_ttls(msg: &mut [u8], l: &Layout, f: impl Fn(u32) -> u32) {
    for &at in &l.ttls {
        let at = usize::from(at);
        if let Some(b) = msg.get_mut(at..at + 4) {
            let ttl = u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
            b.copy_from_slice(&f(ttl).to_be_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use hickory_proto::op::{Edns, Message, MessageType, OpCode, Query};
    use hickory_proto::rr::rdata::{A, TXT};
    use hickory_proto::rr::{Name, RData, Record, RecordType};

    fn u32_at(msg: &[u8], at: usize) -> Option<u32> {
        let b = msg.get(at..at + 4)?;
        Some(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn txt_reply(n: usize) -> Message {
        let name = Name::from_ascii("x.big.test.").unwrap();
        let mut m = Message::new(1, MessageType::Response, OpCode::Query);
        m.add_query(Query::query(name.clone(), RecordType::TXT));
        for i in 0..n {
            m.add_answer(Record::from_rdata(
                name.clone(),
                60 + i as u32,
                RData::TXT(TXT::new(vec![format!("{i:03}{}", "x".repeat(240))])),
            ));
        }
        let mut e = Edns::new();
        e.set_max_payload(4096);
        m.set_edns(e);
        m
    }

    #[test]
    fn walks_every_record_but_the_opt() {
        let m = txt_reply(3);
        let b = m.to_vec().unwrap();
        let l = layout(&b).unwrap();
        assert_eq!(l.ttls.len(), 3);
        assert_eq!(l.question_end, 12 + "x.big.test.".len() + 1 + 4);
        let ttls: Vec<u32> = l
            .ttls
            .iter()
            .map(|&at| u32_at(&b, usize::from(at)).unwrap())
            .collect();
        assert_eq!(ttls, [60, 61, 62]);
        // Truncated, trailing garbage, self-pointing names: no layout.
        assert!(layout(&b[..b.len() - 1]).is_none());
        let mut long = b.clone();
        long.push(0);
        assert!(layout(&long).is_none());
        // A pointer is not followed (the walk only skips it): a name pointing at itself ends.
        let mut lp = b.clone();
        lp[12] = 0xc0;
        lp[13] = 12;
        assert!(layout(&lp).is_none());
    }

    #[test]
    fn clamps_high_bit_ttls_in_place() {
        let mut m = txt_reply(2);
        m.answers[0].ttl = 0x8000_0010;
        m.add_additional(Record::from_rdata(
            Name::from_ascii("a.test.").unwrap(),
            u32::MAX,
            RData::A(A::new(1, 2, 3, 4)),
        ));
        let mut b = m.to_vec().unwrap();
        let l = layout(&b).unwrap();
        map_ttls(&mut b, &l, clamp_ttl);
        let d = Message::from_vec(&b).unwrap();
        assert_eq!(d.answers[0].ttl, 0);
        assert_eq!(d.answers[1].ttl, 61);
        assert_eq!(d.additionals[0].ttl, 0);
        // The OPT is untouched.
        assert_eq!(d.edns.as_ref().map(Edns::max_payload), Some(4096));
    }

    /// Mutated replies (1–3 bytes changed, a deterministic generator): the walk never
    /// panics, and whatever layout it finds stays inside the message.
    #[test]
    fn mutated_messages_never_panic() {
        let mut base = txt_reply(5);
        base.add_additional(Record::from_rdata(
            Name::from_ascii("x.big.test.").unwrap(),
            1,
            RData::A(A::new(1, 2, 3, 4)),
        ));
        let base = base.to_vec().unwrap();
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..20_000 {
            let mut b = base.clone();
            for _ in 0..=(next() % 3) {
                let at = (next() % b.len() as u64) as usize;
                b[at] = next() as u8;
            }
            let cut = b.len() - (next() % 8) as usize;
            b.truncate(cut);
            let _ = question(&b);
            if let Some(l) = layout(&b) {
                assert!(l.question_end <= b.len());
                assert!(l.ttls.iter().all(|&t| usize::from(t) + 4 <= b.len()));
                map_ttls(&mut b, &l, clamp_ttl);
            }
        }
    }
}
