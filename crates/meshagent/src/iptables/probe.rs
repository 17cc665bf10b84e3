//! A process-free probe for "this network namespace has no packet-filter state at all".
//!
//! Reading the state with `iptables-save` costs a process start (about as long as the
//! `iptables-restore` that follows; BENCHMARKS.md), and in a fresh pod namespace — the
//! init container's normal case — there is nothing to read. One netlink dump of the
//! nftables tables (`NFT_MSG_GETTABLE`, every family) plus the legacy table lists in /proc
//! answer that without a process. Any doubt (an error, an unexpected answer) means "maybe",
//! and the caller falls back to `*-save`.

use std::os::fd::AsRawFd;

use nix::sys::socket::{
    self, AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType,
};

const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFT_MSG_NEWTABLE: u16 = 0;
const NFT_MSG_GETTABLE: u16 = 1;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_DUMP: u16 = 0x300;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;

/// True only when it is certain that there are no nftables tables and no legacy iptables
/// tables in this namespace.
pub fn namespace_is_empty() -> bool {
    let legacy_empty = ["/proc/net/ip_tables_names", "/proc/net/ip6_tables_names"]
        .iter()
        .all(|p| std::fs::read_to_string(p).map_or(true, |s| s.trim().is_empty()));
    legacy_empty && nft_tables() == Some(0)
}

/// The number of nftables tables (all families), or `None` if the dump failed.
fn nft_tables() -> Option<usize> {
    let fd = socket::socket(
        AddressFamily::Netlink,
        SockType::Raw,
        SockFlag::SOCK_CLOEXEC,
        SockProtocol::NetlinkNetFilter,
    )
    .ok()?;
    socket::bind(fd.as_raw_fd(), &NetlinkAddr::new(0, 0)).ok()?;
    // nlmsghdr (len, type, flags, seq, pid) + nfgenmsg (family AF_UNSPEC, version 0, res_id 0).
    let mut req = Vec::with_capacity(20);
    req.extend_from_slice(&20u32.to_ne_bytes());
    req.extend_from_slice(&((NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETTABLE).to_ne_bytes());
    req.extend_from_slice(&(NLM_F_REQUEST | NLM_F_DUMP).to_ne_bytes());
    req.extend_from_slice(&1u32.to_ne_bytes());
    req.extend_from_slice(&0u32.to_ne_bytes());
    req.extend_from_slice(&[0, 0, 0, 0]);
    socket::send(fd.as_raw_fd(), &req, MsgFlags::empty()).ok()?;
    let mut tables = 0;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = socket::recv(fd.as_raw_fd(), &mut buf, MsgFlags::empty()).ok()?;
        if n == 0 {
            return None;
        }
        let mut off = 0;
        while off + 16 <= n {
            let len = u32::from_ne_bytes(buf[off..off + 4].try_into().ok()?) as usize;
            let ty = u16::from_ne_bytes(buf[off + 4..off + 6].try_into().ok()?);
            if len < 16 || off + len > n {
                return None;
            }
            match ty {
                NLMSG_DONE => return Some(tables),
                NLMSG_ERROR => return None,
                t if t == (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWTABLE => tables += 1,
                _ => return None,
            }
            off += (len + 3) & !3;
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn probe_answers_in_the_test_namespace() {
        // Whatever the host has, the probe must not fail open: it answers a count or None.
        let _ = super::nft_tables();
    }
}
