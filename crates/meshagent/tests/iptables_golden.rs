//! Golden tests for the `istio-iptables` rule text, iptables-restore and native nftables.
//!
//! Every expectation is written by hand from Istio's capture logic, not from this crate's
//! output. The configurations mirror Istio's own golden cases
//! (tools/istio-iptables/pkg/capture/run_test.go `getCommonTestCases` on the base config
//! 15001/15006/15008, uid=gid 1337, mark 1337, table 133, owner groups `*`, loopback
//! 127.0.0.1/32); as there, IPv6 and the resolv.conf servers are set directly instead of
//! being detected. Facts used throughout (Istio tools/istio-iptables/pkg/capture/run.go
//! `Run` unless noted):
//!
//! - Restore text: one block per table in the order mangle, nat, raw, each `-N` for the Istio
//!   chains in the order they first receive a rule, then the rules in generation order, then
//!   `COMMIT`; v4 first, then v6 when IPv6 is on (builder `BuildV4Restore`/`BuildV6Restore`).
//! - Always: `ISTIO_INBOUND -p tcp --dport <tunnel> -j RETURN`, then `ISTIO_REDIRECT …
//!   --to-ports <-p>` and `ISTIO_IN_REDIRECT … --to-ports <-z>`; `OUTPUT -j ISTIO_OUTPUT`; the
//!   127.0.0.6/::6 passthrough RETURN; per uid then per gid the triplet (lo to non-loopback →
//!   ISTIO_IN_REDIRECT; lo and not the proxy → RETURN; the proxy → RETURN); the loopback-CIDR
//!   RETURN; then excludes and includes.
//! - `-b '*'`: `PREROUTING -p tcp -j ISTIO_INBOUND`, one RETURN per `-d` port, then
//!   `-j ISTIO_IN_REDIRECT` (`handleInboundPortsInclude`).
//! - `-i '*'`: `ISTIO_OUTPUT -j ISTIO_REDIRECT` last (`handleOutboundIncludeRules`).
//! - nftables (tools/istio-nftables): tables `inet istio-proxy-{nat,mangle,raw}` in that
//!   order, `add table` + `flush table`, base chains (prerouting, output) then regular chains
//!   in constant order, only if they receive rules; `counter` on every rule (1.28+);
//!   `-I chain N` → `insert rule … index N-1`, or `add` when the chain is shorter.
//!   Names are written bare as Istio writes them (`iifname eth1`, `skgid != java`) when they
//!   are plain identifiers; any other name is quoted, so none can end its token or the rule.
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)] // tests fail loudly by design

use meshagent::iptables::config::{Config, MapEnv};
use meshagent::iptables::{ISTIO_INIT_DEFAULT_ARGS, nft, rules};

struct Case {
    args: &'static [&'static str],
    env: &'static [(&'static str, &'static str)],
    ipv6: bool,
    dns4: &'static [&'static str],
    dns6: &'static [&'static str],
}

/// [`ISTIO_INIT_DEFAULT_ARGS`] followed by `extra` (leaked: cases hold `'static` slices).
fn injected(extra: &[&'static str]) -> &'static [&'static str] {
    [ISTIO_INIT_DEFAULT_ARGS, extra].concat().leak()
}

const fn case(args: &'static [&'static str]) -> Case {
    Case {
        args,
        env: &[],
        ipv6: false,
        dns4: &[],
        dns6: &[],
    }
}

impl Case {
    const fn ipv6(mut self) -> Self {
        self.ipv6 = true;
        self
    }
    const fn env(mut self, env: &'static [(&'static str, &'static str)]) -> Self {
        self.env = env;
        self
    }
    const fn dns(mut self, v4: &'static [&'static str], v6: &'static [&'static str]) -> Self {
        self.dns4 = v4;
        self.dns6 = v6;
        self
    }
    fn config(&self) -> Config {
        let args: Vec<String> = self.args.iter().map(|s| (*s).to_owned()).collect();
        let env = MapEnv::from_pairs(self.env.iter().copied());
        let mut c =
            Config::from_args(&args, &env).unwrap_or_else(|e| panic!("{:?}: {e}", self.args));
        c.enable_ipv6 = self.ipv6;
        c.dns_servers_v4 = self.dns4.iter().map(|s| (*s).to_owned()).collect();
        c.dns_servers_v6 = self.dns6.iter().map(|s| (*s).to_owned()).collect();
        c
    }
    fn iptables(&self) -> String {
        let plan = rules::build(&self.config());
        format!(
            "{}{}",
            rules::restore_text(&plan.v4),
            rules::restore_text(&plan.v6)
        )
    }
    fn nft(&self) -> String {
        nft::build(&self.config())
    }
}

/// Compares line by line so a failure names the first differing line.
fn check(name: &str, got: &str, want: &str) {
    let g: Vec<&str> = got.lines().collect();
    let w: Vec<&str> = want.lines().collect();
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        assert_eq!(
            a,
            b,
            "{name}: line {} differs\n--- got ---\n{got}\n--- want ---\n{want}",
            i + 1
        );
    }
    assert_eq!(
        g.len(),
        w.len(),
        "{name}: line count differs\n--- got ---\n{got}\n--- want ---\n{want}"
    );
}

// ---------------------------------------------------------------------------------------
// iptables fragments (each a fact of capture/run.go `Run`).

/// nat chains of every run without DNS, and the three fixed rules.
const NAT4: &str = "* nat
-N ISTIO_INBOUND
-N ISTIO_REDIRECT
-N ISTIO_IN_REDIRECT
-N ISTIO_OUTPUT
";
const FIXED: &str = "-A ISTIO_INBOUND -p tcp --dport 15008 -j RETURN
-A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports 15001
-A ISTIO_IN_REDIRECT -p tcp -j REDIRECT --to-ports 15006
";
/// `OUTPUT -j ISTIO_OUTPUT` then the inbound-passthrough source RETURN (127.0.0.6 is what
/// Envoy binds for inbound passthrough).
const OUT4: &str = "-A OUTPUT -j ISTIO_OUTPUT
-A ISTIO_OUTPUT -o lo -s 127.0.0.6/32 -j RETURN
";
const OUT6: &str = "-A OUTPUT -j ISTIO_OUTPUT
-A ISTIO_OUTPUT -o lo -s ::6/128 -j RETURN
";
/// The uid 1337 and gid 1337 triplets, v4.
const OWNER4: &str = "-A ISTIO_OUTPUT -o lo ! -d 127.0.0.1/32 -p tcp ! --dport 15008 -m owner --uid-owner 1337 -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -o lo -m owner ! --uid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -m owner --uid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -o lo ! -d 127.0.0.1/32 -p tcp ! --dport 15008 -m owner --gid-owner 1337 -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -o lo -m owner ! --gid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -m owner --gid-owner 1337 -j RETURN
";
const OWNER6: &str = "-A ISTIO_OUTPUT -o lo ! -d ::1/128 -p tcp ! --dport 15008 -m owner --uid-owner 1337 -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -o lo -m owner ! --uid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -m owner --uid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -o lo ! -d ::1/128 -p tcp ! --dport 15008 -m owner --gid-owner 1337 -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -o lo -m owner ! --gid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -m owner --gid-owner 1337 -j RETURN
";
/// With DNS capture the uid rule skips 53 and the tunnel port via multiport, and the lo
/// RETURNs become TCP-only with `! --dport 53` (a DNS server on localhost stays captured);
/// the gid redirect keeps `! --dport 15008`.
const OWNER4_DNS: &str = "-A ISTIO_OUTPUT -o lo ! -d 127.0.0.1/32 -p tcp -m multiport ! --dports 53,15008 -m owner --uid-owner 1337 -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -o lo -p tcp ! --dport 53 -m owner ! --uid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -m owner --uid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -o lo ! -d 127.0.0.1/32 -p tcp ! --dport 15008 -m owner --gid-owner 1337 -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -o lo -p tcp ! --dport 53 -m owner ! --gid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -m owner --gid-owner 1337 -j RETURN
";
const OWNER6_DNS: &str = "-A ISTIO_OUTPUT -o lo ! -d ::1/128 -p tcp -m multiport ! --dports 53,15008 -m owner --uid-owner 1337 -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -o lo -p tcp ! --dport 53 -m owner ! --uid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -m owner --uid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -o lo ! -d ::1/128 -p tcp ! --dport 15008 -m owner --gid-owner 1337 -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -o lo -p tcp ! --dport 53 -m owner ! --gid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -m owner --gid-owner 1337 -j RETURN
";
const LOOP4: &str = "-A ISTIO_OUTPUT -d 127.0.0.1/32 -j RETURN\n";
const LOOP6: &str = "-A ISTIO_OUTPUT -d ::1/128 -j RETURN\n";
/// `SetupDNSRedir`'s raw table for uid=gid=1337: OUTPUT jump, proxy queries to zone 1 and
/// proxy answers (from 15053) to zone 2 (`addDNSConntrackZones`).
const RAW_ZONES: &str = "-A OUTPUT -j ISTIO_OUTPUT_DNS
-A ISTIO_OUTPUT_DNS -p udp --dport 53 -m owner --uid-owner 1337 -j CT --zone 1
-A ISTIO_OUTPUT_DNS -p udp --sport 15053 -m owner --uid-owner 1337 -j CT --zone 2
-A ISTIO_OUTPUT_DNS -p udp --dport 53 -m owner --gid-owner 1337 -j CT --zone 1
-A ISTIO_OUTPUT_DNS -p udp --sport 15053 -m owner --gid-owner 1337 -j CT --zone 2
";

fn cat(parts: &[&str]) -> String {
    parts.concat()
}

/// (name, config, expected iptables-restore text).
fn iptables_cases() -> Vec<(&'static str, Case, String)> {
    vec![
        (
            // No -b, no -i: only the base chains and the owner rules (Istio golden "empty").
            "empty",
            case(&["-p", "15001", "-z", "15006", "-e", "15008", "-u", "1337", "-g", "1337"]),
            cat(&[NAT4, FIXED, OUT4, OWNER4, LOOP4, "COMMIT\n"]),
        ),
        (
            // -b '*': PREROUTING jump and the catch-all redirect.
            "inbound-ports-wildcard",
            case(&["-b", "*"]),
            cat(&[
                NAT4,
                FIXED,
                "-A PREROUTING -p tcp -j ISTIO_INBOUND\n-A ISTIO_INBOUND -p tcp -j ISTIO_IN_REDIRECT\n",
                OUT4,
                OWNER4,
                LOOP4,
                "COMMIT\n",
            ]),
        ),
        (
            // The injector's default istio-init arguments: -d ports RETURN before the
            // catch-all; -i '*' redirects all remaining outbound; -x '' adds nothing.
            "injected-default",
            case(injected(&["--log_output_level=default:info"])),
            cat(&[
                NAT4,
                FIXED,
                "-A PREROUTING -p tcp -j ISTIO_INBOUND
-A ISTIO_INBOUND -p tcp --dport 15090 -j RETURN
-A ISTIO_INBOUND -p tcp --dport 15021 -j RETURN
-A ISTIO_INBOUND -p tcp --dport 15020 -j RETURN
-A ISTIO_INBOUND -p tcp -j ISTIO_IN_REDIRECT
",
                OUT4,
                OWNER4,
                LOOP4,
                "-A ISTIO_OUTPUT -j ISTIO_REDIRECT\nCOMMIT\n",
            ]),
        ),
        (
            // A port list redirects each port; -d applies only with '*', so it is ignored.
            "inbound-ports-include",
            case(&["-b", "32000,31000", "-d", "15020"]),
            cat(&[
                NAT4,
                FIXED,
                "-A PREROUTING -p tcp -j ISTIO_INBOUND
-A ISTIO_INBOUND -p tcp --dport 32000 -j ISTIO_IN_REDIRECT
-A ISTIO_INBOUND -p tcp --dport 31000 -j ISTIO_IN_REDIRECT
",
                OUT4,
                OWNER4,
                LOOP4,
                "COMMIT\n",
            ]),
        ),
        (
            // TPROXY with a port list: mangle ISTIO_DIVERT (mark + accept), ISTIO_TPROXY,
            // per port established → DIVERT and new → TPROXY; then the mark bookkeeping
            // (CONNMARK save/restore, 1338 for the proxy over lo) and the ISTIO_INBOUND
            // inserts at 1–3 that avoid loops.
            "inbound-ports-tproxy",
            case(&["-m", "TPROXY", "-b", "32000,31000"]),
            cat(&[
                "* mangle
-N ISTIO_DIVERT
-N ISTIO_TPROXY
-N ISTIO_INBOUND
-A ISTIO_DIVERT -j MARK --set-mark 1337
-A ISTIO_DIVERT -j ACCEPT
-A ISTIO_TPROXY ! -d 127.0.0.1/32 -p tcp -j TPROXY --tproxy-mark 1337/0xffffffff --on-port 15006
-A PREROUTING -p tcp -j ISTIO_INBOUND
-A ISTIO_INBOUND -p tcp --dport 32000 -m conntrack --ctstate RELATED,ESTABLISHED -j ISTIO_DIVERT
-A ISTIO_INBOUND -p tcp --dport 32000 -j ISTIO_TPROXY
-A ISTIO_INBOUND -p tcp --dport 31000 -m conntrack --ctstate RELATED,ESTABLISHED -j ISTIO_DIVERT
-A ISTIO_INBOUND -p tcp --dport 31000 -j ISTIO_TPROXY
-A PREROUTING -p tcp -m mark --mark 1337 -j CONNMARK --save-mark
-A OUTPUT -p tcp -o lo -m mark --mark 1337 -j RETURN
-A OUTPUT ! -d 127.0.0.1/32 -p tcp -o lo -m owner --uid-owner 1337 -j MARK --set-mark 1338
-A OUTPUT ! -d 127.0.0.1/32 -p tcp -o lo -m owner --gid-owner 1337 -j MARK --set-mark 1338
-A OUTPUT -p tcp -m connmark --mark 1337 -j CONNMARK --restore-mark
-I ISTIO_INBOUND 1 -p tcp -m mark --mark 1337 -j RETURN
-I ISTIO_INBOUND 2 -p tcp -s 127.0.0.6/32 -i lo -j RETURN
-I ISTIO_INBOUND 3 -p tcp -i lo -m mark ! --mark 1338 -j RETURN
COMMIT
",
                NAT4,
                FIXED,
                OUT4,
                OWNER4,
                LOOP4,
                "COMMIT\n",
            ]),
        ),
        (
            "inbound-ports-wildcard-tproxy",
            case(&["-m", "TPROXY", "-b", "*", "-d", "15020"]),
            cat(&[
                "* mangle
-N ISTIO_DIVERT
-N ISTIO_TPROXY
-N ISTIO_INBOUND
-A ISTIO_DIVERT -j MARK --set-mark 1337
-A ISTIO_DIVERT -j ACCEPT
-A ISTIO_TPROXY ! -d 127.0.0.1/32 -p tcp -j TPROXY --tproxy-mark 1337/0xffffffff --on-port 15006
-A PREROUTING -p tcp -j ISTIO_INBOUND
-A ISTIO_INBOUND -p tcp --dport 15020 -j RETURN
-A ISTIO_INBOUND -p tcp -m conntrack --ctstate RELATED,ESTABLISHED -j ISTIO_DIVERT
-A ISTIO_INBOUND -p tcp -j ISTIO_TPROXY
-A PREROUTING -p tcp -m mark --mark 1337 -j CONNMARK --save-mark
-A OUTPUT -p tcp -o lo -m mark --mark 1337 -j RETURN
-A OUTPUT ! -d 127.0.0.1/32 -p tcp -o lo -m owner --uid-owner 1337 -j MARK --set-mark 1338
-A OUTPUT ! -d 127.0.0.1/32 -p tcp -o lo -m owner --gid-owner 1337 -j MARK --set-mark 1338
-A OUTPUT -p tcp -m connmark --mark 1337 -j CONNMARK --restore-mark
-I ISTIO_INBOUND 1 -p tcp -m mark --mark 1337 -j RETURN
-I ISTIO_INBOUND 2 -p tcp -s 127.0.0.6/32 -i lo -j RETURN
-I ISTIO_INBOUND 3 -p tcp -i lo -m mark ! --mark 1338 -j RETURN
COMMIT
",
                NAT4,
                FIXED,
                OUT4,
                OWNER4,
                LOOP4,
                "COMMIT\n",
            ]),
        ),
        (
            // TPROXY without inbound ports: no DIVERT/TPROXY chains, but the mark rules and
            // the ISTIO_INBOUND inserts are still generated (nft golden inbound-ports-empty-tproxy).
            "inbound-ports-empty-tproxy",
            case(&["-m", "TPROXY"]),
            cat(&[
                "* mangle
-N ISTIO_INBOUND
-A PREROUTING -p tcp -m mark --mark 1337 -j CONNMARK --save-mark
-A OUTPUT -p tcp -o lo -m mark --mark 1337 -j RETURN
-A OUTPUT ! -d 127.0.0.1/32 -p tcp -o lo -m owner --uid-owner 1337 -j MARK --set-mark 1338
-A OUTPUT ! -d 127.0.0.1/32 -p tcp -o lo -m owner --gid-owner 1337 -j MARK --set-mark 1338
-A OUTPUT -p tcp -m connmark --mark 1337 -j CONNMARK --restore-mark
-I ISTIO_INBOUND 1 -p tcp -m mark --mark 1337 -j RETURN
-I ISTIO_INBOUND 2 -p tcp -s 127.0.0.6/32 -i lo -j RETURN
-I ISTIO_INBOUND 3 -p tcp -i lo -m mark ! --mark 1338 -j RETURN
COMMIT
",
                NAT4,
                FIXED,
                OUT4,
                OWNER4,
                LOOP4,
                "COMMIT\n",
            ]),
        ),
        (
            // Istio golden "tproxy": excluded NIC first in nat and mangle, DNS to the
            // resolv.conf server, -x before -i. IPv6 is on but there is no v6 DNS server, so
            // v6 nat has no ISTIO_OUTPUT_DNS jump and v6 raw no PREROUTING zone rules.
            "tproxy",
            case(&["-m", "TPROXY", "-b", "*", "-x", "1.1.0.0/16", "-i", "9.9.0.0/16", "--redirect-dns", "-c", "not-istio-nic"])
                .ipv6()
                .dns(&["127.0.0.53"], &[]),
            cat(&[
                "* mangle
-N ISTIO_DIVERT
-N ISTIO_TPROXY
-N ISTIO_INBOUND
-A PREROUTING -i not-istio-nic -j RETURN
-A OUTPUT -o not-istio-nic -j RETURN
-A ISTIO_DIVERT -j MARK --set-mark 1337
-A ISTIO_DIVERT -j ACCEPT
-A ISTIO_TPROXY ! -d 127.0.0.1/32 -p tcp -j TPROXY --tproxy-mark 1337/0xffffffff --on-port 15006
-A PREROUTING -p tcp -j ISTIO_INBOUND
-A ISTIO_INBOUND -p tcp -m conntrack --ctstate RELATED,ESTABLISHED -j ISTIO_DIVERT
-A ISTIO_INBOUND -p tcp -j ISTIO_TPROXY
-A PREROUTING -p tcp -m mark --mark 1337 -j CONNMARK --save-mark
-A OUTPUT -p tcp -o lo -m mark --mark 1337 -j RETURN
-A OUTPUT ! -d 127.0.0.1/32 -p tcp -o lo -m owner --uid-owner 1337 -j MARK --set-mark 1338
-A OUTPUT ! -d 127.0.0.1/32 -p tcp -o lo -m owner --gid-owner 1337 -j MARK --set-mark 1338
-A OUTPUT -p tcp -m connmark --mark 1337 -j CONNMARK --restore-mark
-I ISTIO_INBOUND 1 -p tcp -m mark --mark 1337 -j RETURN
-I ISTIO_INBOUND 2 -p tcp -s 127.0.0.6/32 -i lo -j RETURN
-I ISTIO_INBOUND 3 -p tcp -i lo -m mark ! --mark 1338 -j RETURN
COMMIT
* nat
-N ISTIO_INBOUND
-N ISTIO_REDIRECT
-N ISTIO_IN_REDIRECT
-N ISTIO_OUTPUT
-N ISTIO_OUTPUT_DNS
-A PREROUTING -i not-istio-nic -j RETURN
-A OUTPUT -o not-istio-nic -j RETURN
",
                FIXED,
                OUT4,
                OWNER4_DNS,
                "-A ISTIO_OUTPUT -j ISTIO_OUTPUT_DNS
-A ISTIO_OUTPUT_DNS -p tcp --dport 53 -d 127.0.0.53/32 -j REDIRECT --to-ports 15053
",
                "-A ISTIO_OUTPUT_DNS -p udp --dport 53 -d 127.0.0.53/32 -j REDIRECT --to-port 15053
",
                LOOP4,
                "-A ISTIO_OUTPUT -d 1.1.0.0/16 -j RETURN
-A ISTIO_OUTPUT -d 9.9.0.0/16 -j ISTIO_REDIRECT
COMMIT
* raw
-N ISTIO_OUTPUT_DNS
-N ISTIO_INBOUND
",
                RAW_ZONES,
                "-A PREROUTING -j ISTIO_INBOUND
-A ISTIO_OUTPUT_DNS -p udp --dport 53 -d 127.0.0.53/32 -j CT --zone 2
-A ISTIO_INBOUND -p udp --sport 53 -s 127.0.0.53/32 -j CT --zone 1
COMMIT
* mangle
-N ISTIO_DIVERT
-N ISTIO_TPROXY
-N ISTIO_INBOUND
-A PREROUTING -i not-istio-nic -j RETURN
-A OUTPUT -o not-istio-nic -j RETURN
-A ISTIO_DIVERT -j MARK --set-mark 1337
-A ISTIO_DIVERT -j ACCEPT
-A ISTIO_TPROXY ! -d ::1/128 -p tcp -j TPROXY --tproxy-mark 1337/0xffffffff --on-port 15006
-A PREROUTING -p tcp -j ISTIO_INBOUND
-A ISTIO_INBOUND -p tcp -m conntrack --ctstate RELATED,ESTABLISHED -j ISTIO_DIVERT
-A ISTIO_INBOUND -p tcp -j ISTIO_TPROXY
-A PREROUTING -p tcp -m mark --mark 1337 -j CONNMARK --save-mark
-A OUTPUT -p tcp -o lo -m mark --mark 1337 -j RETURN
-A OUTPUT ! -d ::1/128 -p tcp -o lo -m owner --uid-owner 1337 -j MARK --set-mark 1338
-A OUTPUT ! -d ::1/128 -p tcp -o lo -m owner --gid-owner 1337 -j MARK --set-mark 1338
-A OUTPUT -p tcp -m connmark --mark 1337 -j CONNMARK --restore-mark
-I ISTIO_INBOUND 1 -p tcp -m mark --mark 1337 -j RETURN
-I ISTIO_INBOUND 2 -p tcp -s ::6/128 -i lo -j RETURN
-I ISTIO_INBOUND 3 -p tcp -i lo -m mark ! --mark 1338 -j RETURN
COMMIT
* nat
-N ISTIO_INBOUND
-N ISTIO_REDIRECT
-N ISTIO_IN_REDIRECT
-N ISTIO_OUTPUT
-A PREROUTING -i not-istio-nic -j RETURN
-A OUTPUT -o not-istio-nic -j RETURN
",
                FIXED,
                OUT6,
                OWNER6_DNS,
                LOOP6,
                "COMMIT
* raw
-N ISTIO_OUTPUT_DNS
",
                RAW_ZONES,
                "COMMIT\n",
            ]),
        ),
        (
            // Excluded NIC: nat PREROUTING/OUTPUT RETURN first (no mangle in REDIRECT mode).
            "basic-exclude-nic",
            case(&["-c", "not-istio-nic", "-b", "*", "-i", "*"]),
            cat(&[
                NAT4,
                "-A PREROUTING -i not-istio-nic -j RETURN\n-A OUTPUT -o not-istio-nic -j RETURN\n",
                FIXED,
                "-A PREROUTING -p tcp -j ISTIO_INBOUND\n-A ISTIO_INBOUND -p tcp -j ISTIO_IN_REDIRECT\n",
                OUT4,
                OWNER4,
                LOOP4,
                "-A ISTIO_OUTPUT -j ISTIO_REDIRECT\nCOMMIT\n",
            ]),
        ),
        (
            // Istio golden "dns-uid-gid": several uids and gids, v4 and v6 servers.
            "dns-uid-gid",
            case(&["--redirect-dns", "-u", "3,4", "-g", "1,2"]).ipv6().dns(&["127.0.0.53"], &["::127.0.0.53"]),
            "* nat
-N ISTIO_INBOUND
-N ISTIO_REDIRECT
-N ISTIO_IN_REDIRECT
-N ISTIO_OUTPUT
-N ISTIO_OUTPUT_DNS
-A ISTIO_INBOUND -p tcp --dport 15008 -j RETURN
-A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports 15001
-A ISTIO_IN_REDIRECT -p tcp -j REDIRECT --to-ports 15006
-A OUTPUT -j ISTIO_OUTPUT
-A ISTIO_OUTPUT -o lo -s 127.0.0.6/32 -j RETURN
-A ISTIO_OUTPUT -o lo ! -d 127.0.0.1/32 -p tcp -m multiport ! --dports 53,15008 -m owner --uid-owner 3 -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -o lo -p tcp ! --dport 53 -m owner ! --uid-owner 3 -j RETURN
-A ISTIO_OUTPUT -m owner --uid-owner 3 -j RETURN
-A ISTIO_OUTPUT -o lo ! -d 127.0.0.1/32 -p tcp -m multiport ! --dports 53,15008 -m owner --uid-owner 4 -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -o lo -p tcp ! --dport 53 -m owner ! --uid-owner 4 -j RETURN
-A ISTIO_OUTPUT -m owner --uid-owner 4 -j RETURN
-A ISTIO_OUTPUT -o lo ! -d 127.0.0.1/32 -p tcp ! --dport 15008 -m owner --gid-owner 1 -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -o lo -p tcp ! --dport 53 -m owner ! --gid-owner 1 -j RETURN
-A ISTIO_OUTPUT -m owner --gid-owner 1 -j RETURN
-A ISTIO_OUTPUT -o lo ! -d 127.0.0.1/32 -p tcp ! --dport 15008 -m owner --gid-owner 2 -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -o lo -p tcp ! --dport 53 -m owner ! --gid-owner 2 -j RETURN
-A ISTIO_OUTPUT -m owner --gid-owner 2 -j RETURN
-A ISTIO_OUTPUT -j ISTIO_OUTPUT_DNS
-A ISTIO_OUTPUT_DNS -p tcp --dport 53 -d 127.0.0.53/32 -j REDIRECT --to-ports 15053
-A ISTIO_OUTPUT_DNS -p udp --dport 53 -d 127.0.0.53/32 -j REDIRECT --to-port 15053
-A ISTIO_OUTPUT -d 127.0.0.1/32 -j RETURN
COMMIT
* raw
-N ISTIO_OUTPUT_DNS
-N ISTIO_INBOUND
-A OUTPUT -j ISTIO_OUTPUT_DNS
-A ISTIO_OUTPUT_DNS -p udp --dport 53 -m owner --uid-owner 3 -j CT --zone 1
-A ISTIO_OUTPUT_DNS -p udp --sport 15053 -m owner --uid-owner 3 -j CT --zone 2
-A ISTIO_OUTPUT_DNS -p udp --dport 53 -m owner --uid-owner 4 -j CT --zone 1
-A ISTIO_OUTPUT_DNS -p udp --sport 15053 -m owner --uid-owner 4 -j CT --zone 2
-A ISTIO_OUTPUT_DNS -p udp --dport 53 -m owner --gid-owner 1 -j CT --zone 1
-A ISTIO_OUTPUT_DNS -p udp --sport 15053 -m owner --gid-owner 1 -j CT --zone 2
-A ISTIO_OUTPUT_DNS -p udp --dport 53 -m owner --gid-owner 2 -j CT --zone 1
-A ISTIO_OUTPUT_DNS -p udp --sport 15053 -m owner --gid-owner 2 -j CT --zone 2
-A PREROUTING -j ISTIO_INBOUND
-A ISTIO_OUTPUT_DNS -p udp --dport 53 -d 127.0.0.53/32 -j CT --zone 2
-A ISTIO_INBOUND -p udp --sport 53 -s 127.0.0.53/32 -j CT --zone 1
COMMIT
* nat
-N ISTIO_INBOUND
-N ISTIO_REDIRECT
-N ISTIO_IN_REDIRECT
-N ISTIO_OUTPUT
-N ISTIO_OUTPUT_DNS
-A ISTIO_INBOUND -p tcp --dport 15008 -j RETURN
-A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports 15001
-A ISTIO_IN_REDIRECT -p tcp -j REDIRECT --to-ports 15006
-A OUTPUT -j ISTIO_OUTPUT
-A ISTIO_OUTPUT -o lo -s ::6/128 -j RETURN
-A ISTIO_OUTPUT -o lo ! -d ::1/128 -p tcp -m multiport ! --dports 53,15008 -m owner --uid-owner 3 -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -o lo -p tcp ! --dport 53 -m owner ! --uid-owner 3 -j RETURN
-A ISTIO_OUTPUT -m owner --uid-owner 3 -j RETURN
-A ISTIO_OUTPUT -o lo ! -d ::1/128 -p tcp -m multiport ! --dports 53,15008 -m owner --uid-owner 4 -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -o lo -p tcp ! --dport 53 -m owner ! --uid-owner 4 -j RETURN
-A ISTIO_OUTPUT -m owner --uid-owner 4 -j RETURN
-A ISTIO_OUTPUT -o lo ! -d ::1/128 -p tcp ! --dport 15008 -m owner --gid-owner 1 -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -o lo -p tcp ! --dport 53 -m owner ! --gid-owner 1 -j RETURN
-A ISTIO_OUTPUT -m owner --gid-owner 1 -j RETURN
-A ISTIO_OUTPUT -o lo ! -d ::1/128 -p tcp ! --dport 15008 -m owner --gid-owner 2 -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -o lo -p tcp ! --dport 53 -m owner ! --gid-owner 2 -j RETURN
-A ISTIO_OUTPUT -m owner --gid-owner 2 -j RETURN
-A ISTIO_OUTPUT -j ISTIO_OUTPUT_DNS
-A ISTIO_OUTPUT_DNS -p tcp --dport 53 -d ::127.0.0.53/128 -j REDIRECT --to-ports 15053
-A ISTIO_OUTPUT_DNS -p udp --dport 53 -d ::127.0.0.53/128 -j REDIRECT --to-port 15053
-A ISTIO_OUTPUT -d ::1/128 -j RETURN
COMMIT
* raw
-N ISTIO_OUTPUT_DNS
-N ISTIO_INBOUND
-A OUTPUT -j ISTIO_OUTPUT_DNS
-A ISTIO_OUTPUT_DNS -p udp --dport 53 -m owner --uid-owner 3 -j CT --zone 1
-A ISTIO_OUTPUT_DNS -p udp --sport 15053 -m owner --uid-owner 3 -j CT --zone 2
-A ISTIO_OUTPUT_DNS -p udp --dport 53 -m owner --uid-owner 4 -j CT --zone 1
-A ISTIO_OUTPUT_DNS -p udp --sport 15053 -m owner --uid-owner 4 -j CT --zone 2
-A ISTIO_OUTPUT_DNS -p udp --dport 53 -m owner --gid-owner 1 -j CT --zone 1
-A ISTIO_OUTPUT_DNS -p udp --sport 15053 -m owner --gid-owner 1 -j CT --zone 2
-A ISTIO_OUTPUT_DNS -p udp --dport 53 -m owner --gid-owner 2 -j CT --zone 1
-A ISTIO_OUTPUT_DNS -p udp --sport 15053 -m owner --gid-owner 2 -j CT --zone 2
-A PREROUTING -j ISTIO_INBOUND
-A ISTIO_OUTPUT_DNS -p udp --dport 53 -d ::127.0.0.53/128 -j CT --zone 2
-A ISTIO_INBOUND -p udp --sport 53 -s ::127.0.0.53/128 -j CT --zone 1
COMMIT
"
            .to_owned(),
        ),
        (
            // --capture-all-dns: no destination match, all port 53 traffic; raw zone rules
            // without addresses, and the raw PREROUTING jump unconditionally.
            "capture-all-dns",
            case(&["--redirect-dns", "--capture-all-dns"]),
            cat(&[
                "* nat
-N ISTIO_INBOUND
-N ISTIO_REDIRECT
-N ISTIO_IN_REDIRECT
-N ISTIO_OUTPUT
-N ISTIO_OUTPUT_DNS
",
                FIXED,
                OUT4,
                OWNER4_DNS,
                "-A ISTIO_OUTPUT -j ISTIO_OUTPUT_DNS
-A ISTIO_OUTPUT_DNS -p tcp --dport 53 -j REDIRECT --to-ports 15053
",
                "-A ISTIO_OUTPUT_DNS -p udp --dport 53 -j REDIRECT --to-port 15053
",
                LOOP4,
                "COMMIT
* raw
-N ISTIO_OUTPUT_DNS
-N ISTIO_INBOUND
",
                RAW_ZONES,
                "-A PREROUTING -j ISTIO_INBOUND
-A ISTIO_OUTPUT_DNS -p udp --dport 53 -j CT --zone 2
-A ISTIO_INBOUND -p udp --sport 53 -j CT --zone 1
COMMIT
",
            ]),
        ),
        (
            // --redirect-dns without capture-all and without servers: DNS capture is
            // disabled with a warning (capture/run.go `Run`).
            "redirect-dns-no-servers",
            case(&["--redirect-dns"]),
            cat(&[NAT4, FIXED, OUT4, OWNER4, LOOP4, "COMMIT\n"]),
        ),
        (
            // --drop-invalid: mangle PREROUTING conntrack INVALID → ISTIO_DROP (all
            // protocols in iptables), before everything else.
            "drop-invalid",
            case(&["--drop-invalid", "-b", "*"]),
            cat(&[
                "* mangle
-N ISTIO_DROP
-A PREROUTING -m conntrack --ctstate INVALID -j ISTIO_DROP
-A ISTIO_DROP -j DROP
COMMIT
",
                NAT4,
                FIXED,
                "-A PREROUTING -p tcp -j ISTIO_INBOUND\n-A ISTIO_INBOUND -p tcp -j ISTIO_IN_REDIRECT\n",
                OUT4,
                OWNER4,
                LOOP4,
                "COMMIT\n",
            ]),
        ),
        (
            // ISTIO_OUTBOUND_IPV4_LOOPBACK_CIDR replaces 127.0.0.1/32 in the lo redirect and
            // the loopback RETURN (and in TPROXY's `! -d`).
            "host-ipv4-loopback-cidr",
            case(&["-i", "*"]).env(&[("ISTIO_OUTBOUND_IPV4_LOOPBACK_CIDR", "127.1.2.3/32")]),
            cat(&[
                NAT4,
                FIXED,
                OUT4,
                "-A ISTIO_OUTPUT -o lo ! -d 127.1.2.3/32 -p tcp ! --dport 15008 -m owner --uid-owner 1337 -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -o lo -m owner ! --uid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -m owner --uid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -o lo ! -d 127.1.2.3/32 -p tcp ! --dport 15008 -m owner --gid-owner 1337 -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -o lo -m owner ! --gid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -m owner --gid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -d 127.1.2.3/32 -j RETURN
-A ISTIO_OUTPUT -j ISTIO_REDIRECT
COMMIT
",
            ]),
        ),
        (
            // -x before -i; each CIDR printed as Go's netip.Prefix.String() (as written).
            "ip-range",
            case(&["-i", "9.9.0.0/16", "-x", "1.1.0.0/16,2.2.0.0/16"]),
            cat(&[
                NAT4,
                FIXED,
                OUT4,
                OWNER4,
                LOOP4,
                "-A ISTIO_OUTPUT -d 1.1.0.0/16 -j RETURN
-A ISTIO_OUTPUT -d 2.2.0.0/16 -j RETURN
-A ISTIO_OUTPUT -d 9.9.0.0/16 -j ISTIO_REDIRECT
COMMIT
",
            ]),
        ),
        (
            // v6 CIDRs are dropped from v4 rules (separateV4V6) and IPv6 is off.
            "ipnets",
            case(&["-i", "10.0.0.0/8,172.16.0.0/16,fd00::/8", "-x", "10.1.0.0/16"]),
            cat(&[
                NAT4,
                FIXED,
                OUT4,
                OWNER4,
                LOOP4,
                "-A ISTIO_OUTPUT -d 10.1.0.0/16 -j RETURN
-A ISTIO_OUTPUT -d 10.0.0.0/8 -j ISTIO_REDIRECT
-A ISTIO_OUTPUT -d 172.16.0.0/16 -j ISTIO_REDIRECT
COMMIT
",
            ]),
        ),
        (
            // kube-virt: `-I PREROUTING 1 -i X -j RETURN` early, and per include CIDR
            // `-I PREROUTING 1 -i X -d C -j ISTIO_REDIRECT` before the ISTIO_OUTPUT append.
            "ipnets-with-kube-virt-interfaces",
            case(&["-i", "10.0.0.0/8", "-k", "eth1,eth2"]),
            cat(&[
                NAT4,
                "-I PREROUTING 1 -i eth1 -j RETURN\n-I PREROUTING 1 -i eth2 -j RETURN\n",
                FIXED,
                OUT4,
                OWNER4,
                LOOP4,
                "-I PREROUTING 1 -i eth1 -d 10.0.0.0/8 -j ISTIO_REDIRECT
-I PREROUTING 1 -i eth2 -d 10.0.0.0/8 -j ISTIO_REDIRECT
-A ISTIO_OUTPUT -d 10.0.0.0/8 -j ISTIO_REDIRECT
COMMIT
",
            ]),
        ),
        (
            // kube-virt with -i '*': the interface redirect has no -d.
            "kube-virt-interfaces",
            case(&["-i", "*", "-k", "eth1,eth2", "-b", "*"]),
            cat(&[
                NAT4,
                "-I PREROUTING 1 -i eth1 -j RETURN\n-I PREROUTING 1 -i eth2 -j RETURN\n",
                FIXED,
                "-A PREROUTING -p tcp -j ISTIO_INBOUND\n-A ISTIO_INBOUND -p tcp -j ISTIO_IN_REDIRECT\n",
                OUT4,
                OWNER4,
                LOOP4,
                "-A ISTIO_OUTPUT -j ISTIO_REDIRECT
-I PREROUTING 1 -i eth1 -j ISTIO_REDIRECT
-I PREROUTING 1 -i eth2 -j ISTIO_REDIRECT
COMMIT
",
            ]),
        ),
        (
            // A loopback include CIDR drops the `-o lo ! --uid/gid-owner … RETURN` rules.
            "loopback-outbound-iprange",
            case(&["-i", "127.1.2.3/32", "-b", "7777,8888"]),
            cat(&[
                NAT4,
                FIXED,
                "-A PREROUTING -p tcp -j ISTIO_INBOUND
-A ISTIO_INBOUND -p tcp --dport 7777 -j ISTIO_IN_REDIRECT
-A ISTIO_INBOUND -p tcp --dport 8888 -j ISTIO_IN_REDIRECT
",
                OUT4,
                "-A ISTIO_OUTPUT -o lo ! -d 127.0.0.1/32 -p tcp ! --dport 15008 -m owner --uid-owner 1337 -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -m owner --uid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -o lo ! -d 127.0.0.1/32 -p tcp ! --dport 15008 -m owner --gid-owner 1337 -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -m owner --gid-owner 1337 -j RETURN
",
                LOOP4,
                "-A ISTIO_OUTPUT -d 127.1.2.3/32 -j ISTIO_REDIRECT
COMMIT
",
            ]),
        ),
        (
            // Owner-group include list: one RETURN for traffic of none of the groups.
            "outbound-owner-groups",
            case(&["-i", "*"]).env(&[("ISTIO_OUTBOUND_OWNER_GROUPS", "java,202")]),
            cat(&[
                NAT4,
                FIXED,
                OUT4,
                OWNER4,
                "-A ISTIO_OUTPUT -m owner ! --gid-owner java -m owner ! --gid-owner 202 -j RETURN\n",
                LOOP4,
                "-A ISTIO_OUTPUT -j ISTIO_REDIRECT\nCOMMIT\n",
            ]),
        ),
        (
            // Owner-group exclude list: one RETURN per group.
            "outbound-owner-groups-exclude",
            case(&["-i", "*"]).env(&[("ISTIO_OUTBOUND_OWNER_GROUPS_EXCLUDE", "888,ftp")]),
            cat(&[
                NAT4,
                FIXED,
                OUT4,
                OWNER4,
                "-A ISTIO_OUTPUT -m owner --gid-owner 888 -j RETURN\n-A ISTIO_OUTPUT -m owner --gid-owner ftp -j RETURN\n",
                LOOP4,
                "-A ISTIO_OUTPUT -j ISTIO_REDIRECT\nCOMMIT\n",
            ]),
        ),
        (
            // -q: TCP redirect per port after the CIDR excludes, before the CIDR includes.
            "outbound-ports-include",
            case(&["-q", "32000,31000", "-x", "10.0.0.0/8"]),
            cat(&[
                NAT4,
                FIXED,
                OUT4,
                OWNER4,
                LOOP4,
                "-A ISTIO_OUTPUT -d 10.0.0.0/8 -j RETURN
-A ISTIO_OUTPUT -p tcp --dport 32000 -j ISTIO_REDIRECT
-A ISTIO_OUTPUT -p tcp --dport 31000 -j ISTIO_REDIRECT
COMMIT
",
            ]),
        ),
        (
            // -o: TCP and UDP RETURN per port right after the OUTPUT jump, before 127.0.0.6.
            "outbound-ports-exclude",
            case(&["-o", "25,465", "-i", "*"]),
            cat(&[
                NAT4,
                FIXED,
                "-A OUTPUT -j ISTIO_OUTPUT
-A ISTIO_OUTPUT -p tcp --dport 25 -j RETURN
-A ISTIO_OUTPUT -p udp --dport 25 -j RETURN
-A ISTIO_OUTPUT -p tcp --dport 465 -j RETURN
-A ISTIO_OUTPUT -p udp --dport 465 -j RETURN
-A ISTIO_OUTPUT -o lo -s 127.0.0.6/32 -j RETURN
",
                OWNER4,
                LOOP4,
                "-A ISTIO_OUTPUT -j ISTIO_REDIRECT\nCOMMIT\n",
            ]),
        ),
        (
            // IPv6 on, nothing captured: the same rules in ip6tables with ::6 and ::1.
            "ipv6-empty-inbound-ports",
            case(&["-b", ""]).ipv6(),
            cat(&[NAT4, FIXED, OUT4, OWNER4, LOOP4, "COMMIT\n", NAT4, FIXED, OUT6, OWNER6, LOOP6, "COMMIT\n"]),
        ),
        (
            "ipv6-inbound-ports",
            case(&["-b", "4000,5000"]).ipv6(),
            cat(&[
                NAT4,
                FIXED,
                "-A PREROUTING -p tcp -j ISTIO_INBOUND
-A ISTIO_INBOUND -p tcp --dport 4000 -j ISTIO_IN_REDIRECT
-A ISTIO_INBOUND -p tcp --dport 5000 -j ISTIO_IN_REDIRECT
",
                OUT4,
                OWNER4,
                LOOP4,
                "COMMIT\n",
                NAT4,
                FIXED,
                "-A PREROUTING -p tcp -j ISTIO_INBOUND
-A ISTIO_INBOUND -p tcp --dport 4000 -j ISTIO_IN_REDIRECT
-A ISTIO_INBOUND -p tcp --dport 5000 -j ISTIO_IN_REDIRECT
",
                OUT6,
                OWNER6,
                LOOP6,
                "COMMIT\n",
            ]),
        ),
        (
            // Mixed CIDR lists are split per family (`separateV4V6`).
            "ipv6-ipnets",
            case(&["-i", "10.0.0.0/8,fd04::/16", "-x", "10.1.0.0/16,fd05::/16"]).ipv6(),
            cat(&[
                NAT4,
                FIXED,
                OUT4,
                OWNER4,
                LOOP4,
                "-A ISTIO_OUTPUT -d 10.1.0.0/16 -j RETURN
-A ISTIO_OUTPUT -d 10.0.0.0/8 -j ISTIO_REDIRECT
COMMIT
",
                NAT4,
                FIXED,
                OUT6,
                OWNER6,
                LOOP6,
                "-A ISTIO_OUTPUT -d fd05::/16 -j RETURN
-A ISTIO_OUTPUT -d fd04::/16 -j ISTIO_REDIRECT
COMMIT
",
            ]),
        ),
        (
            "ipv6-outbound-ports",
            case(&["-q", "32000,31000"]).ipv6(),
            cat(&[
                NAT4,
                FIXED,
                OUT4,
                OWNER4,
                LOOP4,
                "-A ISTIO_OUTPUT -p tcp --dport 32000 -j ISTIO_REDIRECT
-A ISTIO_OUTPUT -p tcp --dport 31000 -j ISTIO_REDIRECT
COMMIT
",
                NAT4,
                FIXED,
                OUT6,
                OWNER6,
                LOOP6,
                "-A ISTIO_OUTPUT -p tcp --dport 32000 -j ISTIO_REDIRECT
-A ISTIO_OUTPUT -p tcp --dport 31000 -j ISTIO_REDIRECT
COMMIT
",
            ]),
        ),
        (
            // uid list then gid list, each a triplet.
            "ipv6-uid-gid",
            case(&["-u", "1,2", "-g", "3"]).ipv6(),
            cat(&[
                NAT4,
                FIXED,
                OUT4,
                "-A ISTIO_OUTPUT -o lo ! -d 127.0.0.1/32 -p tcp ! --dport 15008 -m owner --uid-owner 1 -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -o lo -m owner ! --uid-owner 1 -j RETURN
-A ISTIO_OUTPUT -m owner --uid-owner 1 -j RETURN
-A ISTIO_OUTPUT -o lo ! -d 127.0.0.1/32 -p tcp ! --dport 15008 -m owner --uid-owner 2 -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -o lo -m owner ! --uid-owner 2 -j RETURN
-A ISTIO_OUTPUT -m owner --uid-owner 2 -j RETURN
-A ISTIO_OUTPUT -o lo ! -d 127.0.0.1/32 -p tcp ! --dport 15008 -m owner --gid-owner 3 -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -o lo -m owner ! --gid-owner 3 -j RETURN
-A ISTIO_OUTPUT -m owner --gid-owner 3 -j RETURN
",
                LOOP4,
                "COMMIT\n",
                NAT4,
                FIXED,
                OUT6,
                "-A ISTIO_OUTPUT -o lo ! -d ::1/128 -p tcp ! --dport 15008 -m owner --uid-owner 1 -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -o lo -m owner ! --uid-owner 1 -j RETURN
-A ISTIO_OUTPUT -m owner --uid-owner 1 -j RETURN
-A ISTIO_OUTPUT -o lo ! -d ::1/128 -p tcp ! --dport 15008 -m owner --uid-owner 2 -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -o lo -m owner ! --uid-owner 2 -j RETURN
-A ISTIO_OUTPUT -m owner --uid-owner 2 -j RETURN
-A ISTIO_OUTPUT -o lo ! -d ::1/128 -p tcp ! --dport 15008 -m owner --gid-owner 3 -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -o lo -m owner ! --gid-owner 3 -j RETURN
-A ISTIO_OUTPUT -m owner --gid-owner 3 -j RETURN
",
                LOOP6,
                "COMMIT\n",
            ]),
        ),
        (
            "ipv6-virt-interfaces",
            case(&["-k", "eth1", "-i", "*"]).ipv6(),
            cat(&[
                NAT4,
                "-I PREROUTING 1 -i eth1 -j RETURN\n",
                FIXED,
                OUT4,
                OWNER4,
                LOOP4,
                "-A ISTIO_OUTPUT -j ISTIO_REDIRECT\n-I PREROUTING 1 -i eth1 -j ISTIO_REDIRECT\nCOMMIT\n",
                NAT4,
                "-I PREROUTING 1 -i eth1 -j RETURN\n",
                FIXED,
                OUT6,
                OWNER6,
                LOOP6,
                "-A ISTIO_OUTPUT -j ISTIO_REDIRECT\n-I PREROUTING 1 -i eth1 -j ISTIO_REDIRECT\nCOMMIT\n",
            ]),
        ),
        (
            // DNS + owner-group include: the group RETURN in ISTIO_OUTPUT, and its UDP/53
            // twin in ISTIO_OUTPUT_DNS so other groups' DNS is not captured either.
            "ipv6-dns-outbound-owner-groups",
            case(&["--redirect-dns"])
                .ipv6()
                .dns(&["10.96.0.10"], &["fd00::10"])
                .env(&[("ISTIO_OUTBOUND_OWNER_GROUPS", "java,202")]),
            cat(&[
                "* nat
-N ISTIO_INBOUND
-N ISTIO_REDIRECT
-N ISTIO_IN_REDIRECT
-N ISTIO_OUTPUT
-N ISTIO_OUTPUT_DNS
",
                FIXED,
                OUT4,
                OWNER4_DNS,
                "-A ISTIO_OUTPUT -m owner ! --gid-owner java -m owner ! --gid-owner 202 -j RETURN
-A ISTIO_OUTPUT -j ISTIO_OUTPUT_DNS
-A ISTIO_OUTPUT_DNS -p tcp --dport 53 -d 10.96.0.10/32 -j REDIRECT --to-ports 15053
",
                "-A ISTIO_OUTPUT_DNS -p udp --dport 53 -d 10.96.0.10/32 -j REDIRECT --to-port 15053
",
                LOOP4,
                "COMMIT
* raw
-N ISTIO_OUTPUT_DNS
-N ISTIO_INBOUND
",
                RAW_ZONES,
                "-A PREROUTING -j ISTIO_INBOUND
-A ISTIO_OUTPUT_DNS -p udp --dport 53 -d 10.96.0.10/32 -j CT --zone 2
-A ISTIO_INBOUND -p udp --sport 53 -s 10.96.0.10/32 -j CT --zone 1
COMMIT
* nat
-N ISTIO_INBOUND
-N ISTIO_REDIRECT
-N ISTIO_IN_REDIRECT
-N ISTIO_OUTPUT
-N ISTIO_OUTPUT_DNS
",
                FIXED,
                OUT6,
                OWNER6_DNS,
                "-A ISTIO_OUTPUT -m owner ! --gid-owner java -m owner ! --gid-owner 202 -j RETURN
-A ISTIO_OUTPUT -j ISTIO_OUTPUT_DNS
-A ISTIO_OUTPUT_DNS -p tcp --dport 53 -d fd00::10/128 -j REDIRECT --to-ports 15053
",
                "-A ISTIO_OUTPUT_DNS -p udp --dport 53 -d fd00::10/128 -j REDIRECT --to-port 15053
",
                LOOP6,
                "COMMIT
* raw
-N ISTIO_OUTPUT_DNS
-N ISTIO_INBOUND
",
                RAW_ZONES,
                "-A PREROUTING -j ISTIO_INBOUND
-A ISTIO_OUTPUT_DNS -p udp --dport 53 -d fd00::10/128 -j CT --zone 2
-A ISTIO_INBOUND -p udp --sport 53 -s fd00::10/128 -j CT --zone 1
COMMIT
",
            ]),
        ),
        (
            // DNS + owner-group exclude (v4 server only, IPv6 off).
            "dns-outbound-owner-groups-exclude",
            case(&["--redirect-dns"])
                .dns(&["10.96.0.10"], &[])
                .env(&[("ISTIO_OUTBOUND_OWNER_GROUPS_EXCLUDE", "888")]),
            cat(&[
                "* nat
-N ISTIO_INBOUND
-N ISTIO_REDIRECT
-N ISTIO_IN_REDIRECT
-N ISTIO_OUTPUT
-N ISTIO_OUTPUT_DNS
",
                FIXED,
                OUT4,
                OWNER4_DNS,
                "-A ISTIO_OUTPUT -m owner --gid-owner 888 -j RETURN
-A ISTIO_OUTPUT -j ISTIO_OUTPUT_DNS
-A ISTIO_OUTPUT_DNS -p tcp --dport 53 -d 10.96.0.10/32 -j REDIRECT --to-ports 15053
",
                "-A ISTIO_OUTPUT_DNS -p udp --dport 53 -d 10.96.0.10/32 -j REDIRECT --to-port 15053
",
                LOOP4,
                "COMMIT
* raw
-N ISTIO_OUTPUT_DNS
-N ISTIO_INBOUND
",
                RAW_ZONES,
                "-A PREROUTING -j ISTIO_INBOUND
-A ISTIO_OUTPUT_DNS -p udp --dport 53 -d 10.96.0.10/32 -j CT --zone 2
-A ISTIO_INBOUND -p udp --sport 53 -s 10.96.0.10/32 -j CT --zone 1
COMMIT
",
            ]),
        ),
        (
            // Custom ports and TPROXY mark (-p/-z/-e/-t): every use follows the flag.
            "custom-ports-tproxy-mark",
            case(&["-p", "15101", "-z", "15106", "-e", "15108", "-m", "TPROXY", "-t", "1400", "-b", "8080"]),
            "* mangle
-N ISTIO_DIVERT
-N ISTIO_TPROXY
-N ISTIO_INBOUND
-A ISTIO_DIVERT -j MARK --set-mark 1400
-A ISTIO_DIVERT -j ACCEPT
-A ISTIO_TPROXY ! -d 127.0.0.1/32 -p tcp -j TPROXY --tproxy-mark 1400/0xffffffff --on-port 15106
-A PREROUTING -p tcp -j ISTIO_INBOUND
-A ISTIO_INBOUND -p tcp --dport 8080 -m conntrack --ctstate RELATED,ESTABLISHED -j ISTIO_DIVERT
-A ISTIO_INBOUND -p tcp --dport 8080 -j ISTIO_TPROXY
-A PREROUTING -p tcp -m mark --mark 1400 -j CONNMARK --save-mark
-A OUTPUT -p tcp -o lo -m mark --mark 1400 -j RETURN
-A OUTPUT ! -d 127.0.0.1/32 -p tcp -o lo -m owner --uid-owner 1337 -j MARK --set-mark 1338
-A OUTPUT ! -d 127.0.0.1/32 -p tcp -o lo -m owner --gid-owner 1337 -j MARK --set-mark 1338
-A OUTPUT -p tcp -m connmark --mark 1400 -j CONNMARK --restore-mark
-I ISTIO_INBOUND 1 -p tcp -m mark --mark 1400 -j RETURN
-I ISTIO_INBOUND 2 -p tcp -s 127.0.0.6/32 -i lo -j RETURN
-I ISTIO_INBOUND 3 -p tcp -i lo -m mark ! --mark 1338 -j RETURN
COMMIT
* nat
-N ISTIO_INBOUND
-N ISTIO_REDIRECT
-N ISTIO_IN_REDIRECT
-N ISTIO_OUTPUT
-A ISTIO_INBOUND -p tcp --dport 15108 -j RETURN
-A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports 15101
-A ISTIO_IN_REDIRECT -p tcp -j REDIRECT --to-ports 15106
-A OUTPUT -j ISTIO_OUTPUT
-A ISTIO_OUTPUT -o lo -s 127.0.0.6/32 -j RETURN
-A ISTIO_OUTPUT -o lo ! -d 127.0.0.1/32 -p tcp ! --dport 15108 -m owner --uid-owner 1337 -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -o lo -m owner ! --uid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -m owner --uid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -o lo ! -d 127.0.0.1/32 -p tcp ! --dport 15108 -m owner --gid-owner 1337 -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -o lo -m owner ! --gid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -m owner --gid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -d 127.0.0.1/32 -j RETURN
COMMIT
"
            .to_owned(),
        ),
        (
            // The VM form: no arguments, everything from cluster.env variables.
            "vm-env-only",
            case(&[]).env(&[
                ("ISTIO_INBOUND_PORTS", "*"),
                ("ISTIO_LOCAL_EXCLUDE_PORTS", "22"),
                ("ISTIO_SERVICE_CIDR", "*"),
                ("ISTIO_SERVICE_EXCLUDE_CIDR", "169.254.169.254/32"),
                ("ENVOY_USER", "meshagent-test-no-such-user"),
            ]),
            cat(&[
                NAT4,
                FIXED,
                "-A PREROUTING -p tcp -j ISTIO_INBOUND
-A ISTIO_INBOUND -p tcp --dport 22 -j RETURN
-A ISTIO_INBOUND -p tcp -j ISTIO_IN_REDIRECT
",
                OUT4,
                OWNER4,
                LOOP4,
                "-A ISTIO_OUTPUT -d 169.254.169.254/32 -j RETURN
-A ISTIO_OUTPUT -j ISTIO_REDIRECT
COMMIT
",
            ]),
        ),
    ]
}

#[test]
fn iptables_golden() {
    let cases = iptables_cases();
    assert!(cases.len() >= 25, "{} cases", cases.len());
    for (name, case, want) in &cases {
        check(name, &case.iptables(), want);
    }
}

// ---------------------------------------------------------------------------------------
// nftables (tools/istio-nftables/pkg/capture): the same logic as nft rules in inet tables.

fn rule(table: &str, chain: &str, body: &str) -> String {
    format!("add rule inet istio-proxy-{table} {chain} {body}\n")
}
fn n(chain: &str, body: &str) -> String {
    rule("nat", chain, body)
}
fn m(chain: &str, body: &str) -> String {
    rule("mangle", chain, body)
}
fn w(chain: &str, body: &str) -> String {
    rule("raw", chain, body)
}
fn ins(table: &str, chain: &str, index: u32, body: &str) -> String {
    format!("insert rule inet istio-proxy-{table} {chain} index {index} {body}\n")
}

/// `add table` + `flush table`: every run replaces the table's content.
fn table(t: &str) -> String {
    format!("add table inet istio-proxy-{t}\nflush table inet istio-proxy-{t}\n")
}
fn chain(t: &str, c: &str) -> String {
    format!("add chain inet istio-proxy-{t} {c}\n")
}
/// Base chains: nat priority -100, mangle -150 (output as a route chain so a mark change
/// re-routes), raw -300.
fn base(t: &str, hook: &str) -> String {
    let decl = match (t, hook) {
        ("nat", _) => format!("{{ type nat hook {hook} priority -100 ; }}"),
        ("mangle", "output") => "{ type route hook output priority -150 ; }".to_owned(),
        ("mangle", _) => format!("{{ type filter hook {hook} priority -150 ; }}"),
        _ => format!("{{ type filter hook {hook} priority -300 ; }}"),
    };
    format!("add chain inet istio-proxy-{t} {hook} {decl}\n")
}

/// nat table head when prerouting is used (`pre`) and DNS adds istio-output-dns.
fn nat_head(pre: bool, dns: bool) -> String {
    let mut s = table("nat");
    if pre {
        s += &base("nat", "prerouting");
    }
    s += &base("nat", "output");
    for c in [
        "istio-inbound",
        "istio-redirect",
        "istio-in-redirect",
        "istio-output",
    ] {
        s += &chain("nat", c);
    }
    if dns {
        s += &chain("nat", "istio-output-dns");
    }
    s
}

fn nft_fixed() -> String {
    [
        n(
            "istio-inbound",
            "meta l4proto tcp tcp dport 15008 counter return",
        ),
        n(
            "istio-redirect",
            "meta l4proto tcp counter redirect to :15001",
        ),
        n(
            "istio-in-redirect",
            "meta l4proto tcp counter redirect to :15006",
        ),
    ]
    .concat()
}

/// OUTPUT jump and the 127.0.0.6 (and ::6 with IPv6) passthrough RETURN.
fn nft_out(v6: bool) -> String {
    let mut s = n("output", "counter jump istio-output");
    s += &n(
        "istio-output",
        "oifname lo ip saddr 127.0.0.6/32 counter return",
    );
    if v6 {
        s += &n(
            "istio-output",
            "oifname lo ip6 saddr ::6/128 counter return",
        );
    }
    s
}

/// The uid then gid triplets for one id each; `v6` adds the ip6 variant of the redirect,
/// `dns` the DNS forms (uid redirect skips `{ 53, 15008 }`, lo RETURNs are TCP `!= 53`).
fn nft_owner(uid: &str, gid: &str, v6: bool, dns: bool) -> String {
    let mut s = String::new();
    for (key, id) in [("skuid", uid), ("skgid", gid)] {
        let dport = if dns && key == "skuid" {
            "tcp dport != { 53, 15008 }"
        } else {
            "tcp dport != 15008"
        };
        s += &n(
            "istio-output",
            &format!(
                "oifname lo meta l4proto tcp ip daddr != 127.0.0.1/32 {dport} {key} {id} counter jump istio-in-redirect"
            ),
        );
        if v6 {
            s += &n(
                "istio-output",
                &format!(
                    "oifname lo meta l4proto tcp ip6 daddr != ::1/128 {dport} {key} {id} counter jump istio-in-redirect"
                ),
            );
        }
        if dns {
            s += &n(
                "istio-output",
                &format!(
                    "oifname lo meta l4proto tcp tcp dport != 53 {key} != {id} counter return"
                ),
            );
        } else {
            s += &n(
                "istio-output",
                &format!("oifname lo {key} != {id} counter return"),
            );
        }
        s += &n("istio-output", &format!("{key} {id} counter return"));
    }
    s
}

fn nft_loop(v6: bool) -> String {
    let mut s = n("istio-output", "ip daddr 127.0.0.1/32 counter return");
    if v6 {
        s += &n("istio-output", "ip6 daddr ::1/128 counter return");
    }
    s
}

/// TPROXY mark bookkeeping in mangle for uid=gid=1337, and the istio-inbound inserts
/// (`-I … 1/2/3` → index 0/1/2; with IPv6 the ::6 rule is also inserted at index 1).
fn nft_tproxy_tail(v6: bool, chain_has_rules: bool) -> String {
    let mut s = m(
        "prerouting",
        "meta l4proto tcp mark 1337 counter ct mark set mark",
    );
    s += &m(
        "output",
        "oifname lo meta l4proto tcp mark 1337 counter return",
    );
    for key in ["skuid", "skgid"] {
        s += &m(
            "output",
            &format!(
                "oifname lo meta l4proto tcp ip daddr != 127.0.0.1/32 {key} 1337 counter meta mark set 1338"
            ),
        );
        if v6 {
            s += &m(
                "output",
                &format!(
                    "oifname lo meta l4proto tcp ip6 daddr != ::1/128 {key} 1337 counter meta mark set 1338"
                ),
            );
        }
    }
    s += &m(
        "output",
        "meta l4proto tcp ct mark 1337 counter meta mark set ct mark",
    );
    if chain_has_rules {
        s += &ins(
            "mangle",
            "istio-inbound",
            0,
            "meta l4proto tcp mark 1337 counter return",
        );
        s += &ins(
            "mangle",
            "istio-inbound",
            1,
            "iifname lo meta l4proto tcp ip saddr 127.0.0.6/32 counter return",
        );
        if v6 {
            s += &ins(
                "mangle",
                "istio-inbound",
                1,
                "iifname lo meta l4proto tcp ip6 saddr ::6/128 counter return",
            );
        }
        s += &ins(
            "mangle",
            "istio-inbound",
            2,
            "iifname lo meta l4proto tcp mark != 1338 counter return",
        );
    } else {
        // Empty chain: each insert beyond the current length becomes an add.
        s += &m("istio-inbound", "meta l4proto tcp mark 1337 counter return");
        s += &m(
            "istio-inbound",
            "iifname lo meta l4proto tcp ip saddr 127.0.0.6/32 counter return",
        );
        s += &m(
            "istio-inbound",
            "iifname lo meta l4proto tcp mark != 1338 counter return",
        );
    }
    s
}

/// mangle head for TPROXY with inbound ports.
fn mangle_head(divert: bool) -> String {
    let mut s = table("mangle") + &base("mangle", "prerouting") + &base("mangle", "output");
    if divert {
        s += &chain("mangle", "istio-divert");
        s += &chain("mangle", "istio-tproxy");
    }
    s += &chain("mangle", "istio-inbound");
    s
}

fn nft_divert(v6: bool) -> String {
    let mut s = m("istio-divert", "counter meta mark set 1337");
    s += &m("istio-divert", "counter accept");
    s += &m(
        "istio-tproxy",
        "meta l4proto tcp ip daddr != 127.0.0.1/32 tproxy ip to :15006 meta mark set 1337 counter accept",
    );
    if v6 {
        s += &m(
            "istio-tproxy",
            "meta l4proto tcp ip6 daddr != ::1/128 tproxy ip6 to :15006 meta mark set 1337 counter accept",
        );
    }
    s
}

/// Raw table for DNS capture with uid=gid=1337 and the given servers (`ip`/`ip6`, cidr).
fn nft_raw(servers: &[(&str, &str)], all: bool) -> String {
    let mut s = table("raw") + &base("raw", "prerouting") + &base("raw", "output");
    s += &chain("raw", "istio-inbound");
    s += &chain("raw", "istio-output-dns");
    s += &w("output", "counter jump istio-output-dns");
    for key in ["skuid", "skgid"] {
        s += &w(
            "istio-output-dns",
            &format!("udp dport 53 meta {key} 1337 counter ct zone set 1"),
        );
        s += &w(
            "istio-output-dns",
            &format!("udp sport 15053 meta {key} 1337 counter ct zone set 2"),
        );
    }
    s += &w("prerouting", "counter jump istio-inbound");
    if all {
        s += &w("istio-output-dns", "udp dport 53 counter ct zone set 2");
        s += &w("istio-inbound", "udp sport 53 counter ct zone set 1");
    }
    for (fam, cidr) in servers {
        s += &w(
            "istio-output-dns",
            &format!("udp dport 53 {fam} daddr {cidr} counter ct zone set 2"),
        );
        s += &w(
            "istio-inbound",
            &format!("udp sport 53 {fam} saddr {cidr} counter ct zone set 1"),
        );
    }
    s
}

/// DNS redirects in nat for the given servers: TCP then UDP, each to the agent on 15053.
fn nft_dns_redirects(servers: &[(&str, &str)]) -> String {
    let mut s = n("istio-output", "counter jump istio-output-dns");
    for proto in ["tcp", "udp"] {
        for (fam, cidr) in servers {
            s += &n(
                "istio-output-dns",
                &format!("{fam} daddr {cidr} {proto} dport 53 counter redirect to :15053"),
            );
        }
    }
    s
}

const INBOUND_ALL_NFT: [&str; 2] = [
    "meta l4proto tcp counter jump istio-inbound",
    "meta l4proto tcp counter jump istio-in-redirect",
];

fn inbound_all() -> String {
    n("prerouting", INBOUND_ALL_NFT[0]) + &n("istio-inbound", INBOUND_ALL_NFT[1])
}

fn nft_cases() -> Vec<(&'static str, Case, String)> {
    let redirect_all = n("istio-output", "counter jump istio-redirect");
    vec![
        (
            "empty",
            case(&[
                "-p", "15001", "-z", "15006", "-e", "15008", "-u", "1337", "-g", "1337",
            ]),
            nat_head(false, false)
                + &nft_fixed()
                + &nft_out(false)
                + &nft_owner("1337", "1337", false, false)
                + &nft_loop(false),
        ),
        (
            // Istio's default sidecar golden inbound-ports-wildcard.
            "inbound-ports-wildcard",
            case(&["-b", "*"]),
            nat_head(true, false)
                + &nft_fixed()
                + &inbound_all()
                + &nft_out(false)
                + &nft_owner("1337", "1337", false, false)
                + &nft_loop(false),
        ),
        (
            "injected-default",
            case(injected(&[])),
            nat_head(true, false)
                + &nft_fixed()
                + &n("prerouting", "meta l4proto tcp counter jump istio-inbound")
                + &n(
                    "istio-inbound",
                    "meta l4proto tcp tcp dport 15090 counter return",
                )
                + &n(
                    "istio-inbound",
                    "meta l4proto tcp tcp dport 15021 counter return",
                )
                + &n(
                    "istio-inbound",
                    "meta l4proto tcp tcp dport 15020 counter return",
                )
                + &n(
                    "istio-inbound",
                    "meta l4proto tcp counter jump istio-in-redirect",
                )
                + &nft_out(false)
                + &nft_owner("1337", "1337", false, false)
                + &nft_loop(false)
                + &redirect_all,
        ),
        (
            "inbound-ports-include",
            case(&["-b", "32000,31000"]),
            nat_head(true, false)
                + &nft_fixed()
                + &n("prerouting", "meta l4proto tcp counter jump istio-inbound")
                + &n(
                    "istio-inbound",
                    "meta l4proto tcp tcp dport 32000 counter jump istio-in-redirect",
                )
                + &n(
                    "istio-inbound",
                    "meta l4proto tcp tcp dport 31000 counter jump istio-in-redirect",
                )
                + &nft_out(false)
                + &nft_owner("1337", "1337", false, false)
                + &nft_loop(false),
        ),
        (
            "inbound-ports-tproxy",
            case(&["-m", "TPROXY", "-b", "32000,31000"]),
            nat_head(false, false)
                + &nft_fixed()
                + &nft_out(false)
                + &nft_owner("1337", "1337", false, false)
                + &nft_loop(false)
                + "\n"
                + &mangle_head(true)
                + &nft_divert(false)
                + &m("prerouting", "meta l4proto tcp counter jump istio-inbound")
                + &m(
                    "istio-inbound",
                    "meta l4proto tcp ct state related,established tcp dport 32000 counter jump istio-divert",
                )
                + &m(
                    "istio-inbound",
                    "meta l4proto tcp tcp dport 32000 counter jump istio-tproxy",
                )
                + &m(
                    "istio-inbound",
                    "meta l4proto tcp ct state related,established tcp dport 31000 counter jump istio-divert",
                )
                + &m(
                    "istio-inbound",
                    "meta l4proto tcp tcp dport 31000 counter jump istio-tproxy",
                )
                + &nft_tproxy_tail(false, true),
        ),
        (
            "inbound-ports-wildcard-tproxy",
            case(&["-m", "TPROXY", "-b", "*"]),
            nat_head(false, false)
                + &nft_fixed()
                + &nft_out(false)
                + &nft_owner("1337", "1337", false, false)
                + &nft_loop(false)
                + "\n"
                + &mangle_head(true)
                + &nft_divert(false)
                + &m("prerouting", "meta l4proto tcp counter jump istio-inbound")
                + &m(
                    "istio-inbound",
                    "meta l4proto tcp ct state related,established counter jump istio-divert",
                )
                + &m(
                    "istio-inbound",
                    "meta l4proto tcp counter jump istio-tproxy",
                )
                + &nft_tproxy_tail(false, true),
        ),
        (
            // Istio nft golden inbound-ports-empty-tproxy: the inserts land in an empty chain.
            "inbound-ports-empty-tproxy",
            case(&["-m", "TPROXY"]),
            nat_head(false, false)
                + &nft_fixed()
                + &nft_out(false)
                + &nft_owner("1337", "1337", false, false)
                + &nft_loop(false)
                + "\n"
                + &mangle_head(false)
                + &nft_tproxy_tail(false, false),
        ),
        (
            "tproxy",
            case(&[
                "-m",
                "TPROXY",
                "-b",
                "*",
                "-x",
                "1.1.0.0/16",
                "-i",
                "9.9.0.0/16",
                "--redirect-dns",
                "-c",
                "not-istio-nic",
            ])
            .ipv6()
            .dns(&["127.0.0.53"], &[]),
            nat_head(true, true)
                + &n("prerouting", "iifname not-istio-nic counter return")
                + &n("output", "oifname not-istio-nic counter return")
                + &nft_fixed()
                + &nft_out(true)
                + &nft_owner("1337", "1337", true, true)
                + &nft_dns_redirects(&[("ip", "127.0.0.53/32")])
                + &nft_loop(true)
                + &n("istio-output", "ip daddr 1.1.0.0/16 counter return")
                + &n(
                    "istio-output",
                    "ip daddr 9.9.0.0/16 counter jump istio-redirect",
                )
                + "\n"
                + &mangle_head(true)
                + &m("prerouting", "iifname not-istio-nic counter return")
                + &m("output", "oifname not-istio-nic counter return")
                + &nft_divert(true)
                + &m("prerouting", "meta l4proto tcp counter jump istio-inbound")
                + &m(
                    "istio-inbound",
                    "meta l4proto tcp ct state related,established counter jump istio-divert",
                )
                + &m(
                    "istio-inbound",
                    "meta l4proto tcp counter jump istio-tproxy",
                )
                + &nft_tproxy_tail(true, true)
                + "\n"
                + &nft_raw(&[("ip", "127.0.0.53/32")], false),
        ),
        (
            "basic-exclude-nic",
            case(&["-c", "not-istio-nic", "-b", "*", "-i", "*"]),
            nat_head(true, false)
                + &n("prerouting", "iifname not-istio-nic counter return")
                + &n("output", "oifname not-istio-nic counter return")
                + &nft_fixed()
                + &inbound_all()
                + &nft_out(false)
                + &nft_owner("1337", "1337", false, false)
                + &nft_loop(false)
                + &redirect_all,
        ),
        (
            // Servers of both families share the inet table: one jump, v4 then v6 rules.
            "dns-v4-v6",
            case(&["--redirect-dns"])
                .ipv6()
                .dns(&["10.96.0.10"], &["fd00::10"]),
            nat_head(false, true)
                + &nft_fixed()
                + &nft_out(true)
                + &nft_owner("1337", "1337", true, true)
                + &nft_dns_redirects(&[("ip", "10.96.0.10/32"), ("ip6", "fd00::10/128")])
                + &nft_loop(true)
                + "\n"
                + &nft_raw(&[("ip", "10.96.0.10/32"), ("ip6", "fd00::10/128")], false),
        ),
        (
            "capture-all-dns",
            case(&["--redirect-dns", "--capture-all-dns"]),
            nat_head(false, true)
                + &nft_fixed()
                + &nft_out(false)
                + &nft_owner("1337", "1337", false, true)
                + &n("istio-output", "counter jump istio-output-dns")
                + &n(
                    "istio-output-dns",
                    "meta l4proto tcp tcp dport 53 counter redirect to :15053",
                )
                + &n(
                    "istio-output-dns",
                    "udp dport 53 counter redirect to :15053",
                )
                + &nft_loop(false)
                + "\n"
                + &nft_raw(&[], true),
        ),
        (
            "redirect-dns-no-servers",
            case(&["--redirect-dns"]),
            nat_head(false, false)
                + &nft_fixed()
                + &nft_out(false)
                + &nft_owner("1337", "1337", false, false)
                + &nft_loop(false),
        ),
        (
            // The nft drop-invalid is limited to TCP (a documented difference to iptables).
            "drop-invalid",
            case(&["--drop-invalid"]),
            nat_head(false, false)
                + &nft_fixed()
                + &nft_out(false)
                + &nft_owner("1337", "1337", false, false)
                + &nft_loop(false)
                + "\n"
                + &table("mangle")
                + &base("mangle", "prerouting")
                + &chain("mangle", "istio-drop")
                + &m(
                    "prerouting",
                    "meta l4proto tcp ct state invalid counter jump istio-drop",
                )
                + &m("istio-drop", "counter drop"),
        ),
        (
            "host-ipv4-loopback-cidr",
            case(&["-i", "*"]).env(&[("ISTIO_OUTBOUND_IPV4_LOOPBACK_CIDR", "127.1.2.3/32")]),
            nat_head(false, false)
                + &nft_fixed()
                + &nft_out(false)
                + &n(
                    "istio-output",
                    "oifname lo meta l4proto tcp ip daddr != 127.1.2.3/32 tcp dport != 15008 skuid 1337 counter jump istio-in-redirect",
                )
                + &n("istio-output", "oifname lo skuid != 1337 counter return")
                + &n("istio-output", "skuid 1337 counter return")
                + &n(
                    "istio-output",
                    "oifname lo meta l4proto tcp ip daddr != 127.1.2.3/32 tcp dport != 15008 skgid 1337 counter jump istio-in-redirect",
                )
                + &n("istio-output", "oifname lo skgid != 1337 counter return")
                + &n("istio-output", "skgid 1337 counter return")
                + &n("istio-output", "ip daddr 127.1.2.3/32 counter return")
                + &redirect_all,
        ),
        (
            "ip-range",
            case(&["-i", "9.9.0.0/16", "-x", "1.1.0.0/16,2.2.0.0/16"]),
            nat_head(false, false)
                + &nft_fixed()
                + &nft_out(false)
                + &nft_owner("1337", "1337", false, false)
                + &nft_loop(false)
                + &n("istio-output", "ip daddr 1.1.0.0/16 counter return")
                + &n("istio-output", "ip daddr 2.2.0.0/16 counter return")
                + &n(
                    "istio-output",
                    "ip daddr 9.9.0.0/16 counter jump istio-redirect",
                ),
        ),
        (
            // Without IPv6, v6 CIDRs produce no rules.
            "ipnets",
            case(&[
                "-i",
                "10.0.0.0/8,172.16.0.0/16,fd00::/8",
                "-x",
                "10.1.0.0/16",
            ]),
            nat_head(false, false)
                + &nft_fixed()
                + &nft_out(false)
                + &nft_owner("1337", "1337", false, false)
                + &nft_loop(false)
                + &n("istio-output", "ip daddr 10.1.0.0/16 counter return")
                + &n(
                    "istio-output",
                    "ip daddr 10.0.0.0/8 counter jump istio-redirect",
                )
                + &n(
                    "istio-output",
                    "ip daddr 172.16.0.0/16 counter jump istio-redirect",
                ),
        ),
        (
            // kube-virt: the first insert into an empty prerouting is an add; the next ones
            // are inserts at index 0.
            "ipnets-with-kube-virt-interfaces",
            case(&["-i", "10.0.0.0/8", "-k", "eth1,eth2"]),
            nat_head(true, false)
                + &n("prerouting", "iifname eth1 counter return")
                + &ins("nat", "prerouting", 0, "iifname eth2 counter return")
                + &nft_fixed()
                + &nft_out(false)
                + &nft_owner("1337", "1337", false, false)
                + &nft_loop(false)
                + &ins(
                    "nat",
                    "prerouting",
                    0,
                    "iifname eth1 ip daddr 10.0.0.0/8 counter jump istio-redirect",
                )
                + &ins(
                    "nat",
                    "prerouting",
                    0,
                    "iifname eth2 ip daddr 10.0.0.0/8 counter jump istio-redirect",
                )
                + &n(
                    "istio-output",
                    "ip daddr 10.0.0.0/8 counter jump istio-redirect",
                ),
        ),
        (
            "kube-virt-interfaces",
            case(&["-i", "*", "-k", "eth1,eth2", "-b", "*"]),
            nat_head(true, false)
                + &n("prerouting", "iifname eth1 counter return")
                + &ins("nat", "prerouting", 0, "iifname eth2 counter return")
                + &nft_fixed()
                + &inbound_all()
                + &nft_out(false)
                + &nft_owner("1337", "1337", false, false)
                + &nft_loop(false)
                + &redirect_all
                + &ins(
                    "nat",
                    "prerouting",
                    0,
                    "iifname eth1 counter jump istio-redirect",
                )
                + &ins(
                    "nat",
                    "prerouting",
                    0,
                    "iifname eth2 counter jump istio-redirect",
                ),
        ),
        (
            "loopback-outbound-iprange",
            case(&["-i", "127.1.2.3/32"]),
            nat_head(false, false)
                + &nft_fixed()
                + &nft_out(false)
                + &n(
                    "istio-output",
                    "oifname lo meta l4proto tcp ip daddr != 127.0.0.1/32 tcp dport != 15008 skuid 1337 counter jump istio-in-redirect",
                )
                + &n("istio-output", "skuid 1337 counter return")
                + &n(
                    "istio-output",
                    "oifname lo meta l4proto tcp ip daddr != 127.0.0.1/32 tcp dport != 15008 skgid 1337 counter jump istio-in-redirect",
                )
                + &n("istio-output", "skgid 1337 counter return")
                + &nft_loop(false)
                + &n(
                    "istio-output",
                    "ip daddr 127.1.2.3/32 counter jump istio-redirect",
                ),
        ),
        (
            "outbound-owner-groups",
            case(&["-i", "*"]).env(&[("ISTIO_OUTBOUND_OWNER_GROUPS", "java,202")]),
            nat_head(false, false)
                + &nft_fixed()
                + &nft_out(false)
                + &nft_owner("1337", "1337", false, false)
                + &n("istio-output", "skgid != java skgid != 202 counter return")
                + &nft_loop(false)
                + &redirect_all,
        ),
        (
            "outbound-owner-groups-exclude",
            case(&["-i", "*"]).env(&[("ISTIO_OUTBOUND_OWNER_GROUPS_EXCLUDE", "888,ftp")]),
            nat_head(false, false)
                + &nft_fixed()
                + &nft_out(false)
                + &nft_owner("1337", "1337", false, false)
                + &n("istio-output", "skgid 888 counter return")
                + &n("istio-output", "skgid ftp counter return")
                + &nft_loop(false)
                + &redirect_all,
        ),
        (
            "outbound-ports-include",
            case(&["-q", "32000,31000"]),
            nat_head(false, false)
                + &nft_fixed()
                + &nft_out(false)
                + &nft_owner("1337", "1337", false, false)
                + &nft_loop(false)
                + &n(
                    "istio-output",
                    "tcp dport 32000 counter jump istio-redirect",
                )
                + &n(
                    "istio-output",
                    "tcp dport 31000 counter jump istio-redirect",
                ),
        ),
        (
            "outbound-ports-exclude",
            case(&["-o", "25", "-i", "*"]),
            nat_head(false, false)
                + &nft_fixed()
                + &n("output", "counter jump istio-output")
                + &n("istio-output", "tcp dport 25 counter return")
                + &n("istio-output", "udp dport 25 counter return")
                + &n(
                    "istio-output",
                    "oifname lo ip saddr 127.0.0.6/32 counter return",
                )
                + &nft_owner("1337", "1337", false, false)
                + &nft_loop(false)
                + &redirect_all,
        ),
        (
            "ipv6-empty-inbound-ports",
            case(&["-b", ""]).ipv6(),
            nat_head(false, false)
                + &nft_fixed()
                + &nft_out(true)
                + &nft_owner("1337", "1337", true, false)
                + &nft_loop(true),
        ),
        (
            "ipv6-ipnets",
            case(&["-i", "10.0.0.0/8,fd04::/16", "-x", "10.1.0.0/16,fd05::/16"]).ipv6(),
            nat_head(false, false)
                + &nft_fixed()
                + &nft_out(true)
                + &nft_owner("1337", "1337", true, false)
                + &nft_loop(true)
                + &n("istio-output", "ip daddr 10.1.0.0/16 counter return")
                + &n("istio-output", "ip6 daddr fd05::/16 counter return")
                + &n(
                    "istio-output",
                    "ip daddr 10.0.0.0/8 counter jump istio-redirect",
                )
                + &n(
                    "istio-output",
                    "ip6 daddr fd04::/16 counter jump istio-redirect",
                ),
        ),
        (
            "ipv6-uid-gid",
            case(&["-u", "1", "-g", "3"]).ipv6(),
            nat_head(false, false)
                + &nft_fixed()
                + &nft_out(true)
                + &nft_owner("1", "3", true, false)
                + &nft_loop(true),
        ),
        (
            "ipv6-virt-interfaces",
            case(&["-k", "eth1", "-i", "*"]).ipv6(),
            nat_head(true, false)
                + &n("prerouting", "iifname eth1 counter return")
                + &nft_fixed()
                + &nft_out(true)
                + &nft_owner("1337", "1337", true, false)
                + &nft_loop(true)
                + &redirect_all
                + &ins(
                    "nat",
                    "prerouting",
                    0,
                    "iifname eth1 counter jump istio-redirect",
                ),
        ),
        (
            "ipv6-dns-outbound-owner-groups",
            case(&["--redirect-dns"])
                .ipv6()
                .dns(&["10.96.0.10"], &[])
                .env(&[("ISTIO_OUTBOUND_OWNER_GROUPS", "java,202")]),
            nat_head(false, true)
                + &nft_fixed()
                + &nft_out(true)
                + &nft_owner("1337", "1337", true, true)
                + &n("istio-output", "skgid != java skgid != 202 counter return")
                + &nft_dns_redirects(&[("ip", "10.96.0.10/32")])
                + &nft_loop(true)
                + "\n"
                + &nft_raw(&[("ip", "10.96.0.10/32")], false),
        ),
        (
            "custom-ports",
            case(&["-p", "15101", "-z", "15106", "-e", "15108", "-b", "8080"]),
            nat_head(true, false)
                + &n(
                    "istio-inbound",
                    "meta l4proto tcp tcp dport 15108 counter return",
                )
                + &n(
                    "istio-redirect",
                    "meta l4proto tcp counter redirect to :15101",
                )
                + &n(
                    "istio-in-redirect",
                    "meta l4proto tcp counter redirect to :15106",
                )
                + &n("prerouting", "meta l4proto tcp counter jump istio-inbound")
                + &n(
                    "istio-inbound",
                    "meta l4proto tcp tcp dport 8080 counter jump istio-in-redirect",
                )
                + &nft_out(false)
                + &n(
                    "istio-output",
                    "oifname lo meta l4proto tcp ip daddr != 127.0.0.1/32 tcp dport != 15108 skuid 1337 counter jump istio-in-redirect",
                )
                + &n("istio-output", "oifname lo skuid != 1337 counter return")
                + &n("istio-output", "skuid 1337 counter return")
                + &n(
                    "istio-output",
                    "oifname lo meta l4proto tcp ip daddr != 127.0.0.1/32 tcp dport != 15108 skgid 1337 counter jump istio-in-redirect",
                )
                + &n("istio-output", "oifname lo skgid != 1337 counter return")
                + &n("istio-output", "skgid 1337 counter return")
                + &nft_loop(false),
        ),
    ]
}

#[test]
fn nft_golden() {
    let cases = nft_cases();
    assert!(cases.len() >= 25, "{} cases", cases.len());
    for (name, case, want) in &cases {
        check(name, &case.nft(), want);
    }
}

#[test]
fn nft_cleanup_deletes_the_three_tables() {
    // Istio's --cleanup-only with nftables: add (so delete cannot fail) then delete.
    let want = "add table inet istio-proxy-nat
delete table inet istio-proxy-nat
add table inet istio-proxy-mangle
delete table inet istio-proxy-mangle
add table inet istio-proxy-raw
delete table inet istio-proxy-raw
";
    check("nft-cleanup", &nft::cleanup(), want);
}
