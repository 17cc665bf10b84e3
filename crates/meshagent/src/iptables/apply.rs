//! The thin layer that touches the system: picks the iptables binaries, reads the current
//! state with `*-save`, and applies with `*-restore --noflush`, `nft -f -` and `ip`.
//!
//! Istio: tools/istio-iptables/pkg/dependencies/implementation.go (`DetectIptablesVersion`,
//! `Run`), capture/run.go `executeCommands`, capture/helper.go `VerifyIptablesState`,
//! capture/run_linux.go `ConfigureRoutes`.
#![allow(
    clippy::disallowed_methods,
    reason = "istio-iptables runs synchronously as its own command; no runtime is serving"
)]

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use super::config::{Config, ForcedBinary, InterceptionMode};
use super::rules::{self, Rule, RuleSet, Table, is_builtin};

/// A command that failed or could not start.
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    #[error("cannot run {cmd}: {error}")]
    Spawn { cmd: String, error: std::io::Error },
    #[error("{cmd} failed ({status}): {stderr}")]
    Failed {
        cmd: String,
        status: String,
        stderr: String,
    },
    #[error(
        "nativeNftables is enabled, but the nft binary is missing in the sidecar container image: \
         no `nft` in PATH ({path})"
    )]
    NftMissing { path: String },
    #[error("no iptables binary found in PATH ({path}); install iptables (legacy or nft)")]
    IptablesMissing { path: String },
    #[error("{0}")]
    Netlink(String),
    #[error("cannot write {path}: {error}")]
    DryRunFile { path: String, error: std::io::Error },
}

/// The three binaries of one iptables flavour and family.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Binaries {
    pub iptables: String,
    pub save: String,
    pub restore: String,
    /// Whether `--wait` is passed (xtables lock).
    pub wait: bool,
}

impl Binaries {
    fn named(base: &str, flavour: Option<&str>) -> Self {
        let stem = match flavour {
            Some(f) => format!("{base}-{f}"),
            None => base.to_owned(),
        };
        Self {
            save: format!("{stem}-save"),
            restore: format!("{stem}-restore"),
            iptables: stem,
            wait: true,
        }
    }
}

/// Runs external commands, or (dry run) only prints them.
pub struct System {
    pub dry_run: bool,
    /// What a dry run would have done, in order: each command line, then its input (printed
    /// on stdout).
    pub transcript: String,
    /// A dry run of the iptables backend in the form Istio's dry-run dependencies record it
    /// for `DRY_RUN_FILE_PATH` (`tools/istio-iptables/pkg/dependencies/stub.go`): a command
    /// run without input as its command line, a restore as its input lines only; the routes
    /// (netlink in Istio, not through those dependencies) are not in it.
    pub record: Vec<String>,
}

/// Output of a finished command.
pub struct Output {
    pub stdout: String,
}

impl System {
    pub fn new(dry_run: bool) -> Self {
        Self {
            dry_run,
            transcript: String::new(),
            record: Vec::new(),
        }
    }

    /// Runs `cmd args` with `stdin`; a non-zero exit is an error carrying stderr.
    pub fn run(
        &mut self,
        cmd: &str,
        args: &[&str],
        stdin: Option<&str>,
    ) -> Result<Output, ApplyError> {
        let shown = if args.is_empty() {
            cmd.to_owned()
        } else {
            format!("{cmd} {}", args.join(" "))
        };
        if self.dry_run {
            self.transcript.push_str(&shown);
            self.transcript.push('\n');
            if let Some(input) = stdin {
                self.transcript.push_str(input);
                self.record.extend(input.lines().map(str::to_owned));
            }
            return Ok(Output {
                stdout: String::new(),
            });
        }
        tracing::debug!("running {shown}");
        let mut child = Command::new(cmd)
            .args(args)
            .stdin(if stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|error| ApplyError::Spawn {
                cmd: shown.clone(),
                error,
            })?;
        if let (Some(input), Some(mut pipe)) = (stdin, child.stdin.take()) {
            pipe.write_all(input.as_bytes())
                .map_err(|error| ApplyError::Spawn {
                    cmd: shown.clone(),
                    error,
                })?;
        }
        let out = child
            .wait_with_output()
            .map_err(|error| ApplyError::Spawn {
                cmd: shown.clone(),
                error,
            })?;
        if !out.status.success() {
            return Err(ApplyError::Failed {
                cmd: shown,
                status: out.status.to_string(),
                stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
            });
        }
        Ok(Output {
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        })
    }
}

/// `cmd` found in `$PATH`.
pub fn in_path(cmd: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(cmd))
        .find(|p| is_executable(p))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

fn path_var() -> String {
    std::env::var("PATH").unwrap_or_default()
}

/// Istio `DetectIptablesVersion`, per family: forced flavour; else legacy when the netns
/// already has legacy rules; else nft when present; else plain `iptables`.
pub fn detect_binaries(
    sys: &mut System,
    forced: Option<ForcedBinary>,
    v6: bool,
) -> Result<Binaries, ApplyError> {
    let base = if v6 { "ip6tables" } else { "iptables" };
    if let Some(f) = forced {
        let flavour = match f {
            ForcedBinary::Legacy => "legacy",
            ForcedBinary::Nft => "nft",
        };
        return Ok(Binaries::named(base, Some(flavour)));
    }
    if sys.dry_run {
        return Ok(Binaries::named(base, None));
    }
    let legacy = Binaries::named(base, Some("legacy"));
    // Legacy tables of this netns are listed here once instantiated: without any, there are
    // no legacy rules, and the `*-legacy-save` probe (a process start) is not needed.
    let names = if v6 {
        "/proc/net/ip6_tables_names"
    } else {
        "/proc/net/ip_tables_names"
    };
    let has_tables = std::fs::read_to_string(names).is_ok_and(|s| !s.trim().is_empty());
    if has_tables && in_path(&legacy.save).is_some() {
        let out = sys.run(&legacy.save, &[], None)?;
        if out.stdout.lines().any(|l| l.starts_with("-A ")) {
            return Ok(legacy);
        }
    }
    let nft = Binaries::named(base, Some("nft"));
    if in_path(&nft.restore).is_some() {
        return Ok(nft);
    }
    let plain = Binaries::named(base, None);
    if in_path(&plain.restore).is_some() {
        return Ok(plain);
    }
    Err(ApplyError::IptablesMissing { path: path_var() })
}

/// One family's `*-save` output, parsed: table → chain → rule specs (after `-A CHAIN `).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct SavedState {
    pub tables: BTreeMap<String, BTreeMap<String, Vec<String>>>,
}

impl SavedState {
    pub fn parse(save: &str) -> Self {
        let mut s = SavedState::default();
        let mut table: Option<String> = None;
        for line in save.lines() {
            if let Some(t) = line.strip_prefix('*') {
                let t = t.trim().to_owned();
                s.tables.entry(t.clone()).or_default();
                table = Some(t);
            } else if let (Some(c), Some(t)) = (line.strip_prefix(':'), &table) {
                let chain = c.split_whitespace().next().unwrap_or_default().to_owned();
                s.tables
                    .entry(t.clone())
                    .or_default()
                    .entry(chain)
                    .or_default();
            } else if let (Some(r), Some(t)) = (line.strip_prefix("-A "), &table) {
                let (chain, spec) = r.split_once(' ').unwrap_or((r, ""));
                s.tables
                    .entry(t.clone())
                    .or_default()
                    .entry(chain.to_owned())
                    .or_default()
                    .push(spec.to_owned());
            }
        }
        s
    }

    /// Istio chains present, per table.
    fn istio_chains(&self, table: &str) -> Vec<String> {
        self.tables
            .get(table)
            .map(|c| {
                c.keys()
                    .filter(|k| k.starts_with("ISTIO_"))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Rules in built-in chains that jump to an Istio chain: (chain, spec).
    fn istio_jumps(&self, table: &str) -> Vec<(String, String)> {
        let mut out = Vec::new();
        if let Some(chains) = self.tables.get(table) {
            for (chain, specs) in chains.iter().filter(|(c, _)| is_builtin(c)) {
                for spec in specs.iter().filter(|s| jumps_to_istio(s)) {
                    out.push((chain.clone(), spec.clone()));
                }
            }
        }
        out
    }

    /// Any Istio state (residue).
    pub fn has_istio(&self) -> bool {
        self.tables
            .keys()
            .any(|t| !self.istio_chains(t).is_empty() || !self.istio_jumps(t).is_empty())
    }
}

fn jumps_to_istio(spec: &str) -> bool {
    let mut it = spec.split_whitespace();
    while let Some(tok) = it.next() {
        if (tok == "-j" || tok == "-g") && it.next().is_some_and(|t| t.starts_with("ISTIO_")) {
            return true;
        }
    }
    false
}

fn tokens(spec: &str) -> Vec<&str> {
    spec.split_whitespace().collect()
}

fn canon_rule(r: &Rule) -> Vec<String> {
    super::canon::canon(&r.args.iter().map(String::as_str).collect::<Vec<_>>())
}

/// Cleanup candidates: the plan's built-in rules plus those the same config would add in
/// TPROXY mode, so `--cleanup-only` without `-m TPROXY` still removes a TPROXY run's marks.
pub fn cleanup_candidates(cfg: &Config, v6: bool) -> Vec<Rule> {
    let mut tproxy = cfg.clone();
    tproxy.mode = InterceptionMode::Tproxy;
    tproxy.inbound_ports = super::config::PortSelection::All;
    tproxy.enable_ipv6 = cfg.enable_ipv6;
    let pick = |rs: RuleSet| if v6 { rs.v6 } else { rs.v4 };
    let mut out = pick(rules::build(cfg));
    for r in pick(rules::build(&tproxy)) {
        if !out.contains(&r) {
            out.push(r);
        }
    }
    out
}

/// Istio `VerifyIptablesState`: (residue, delta). Residue: Istio chains or jumps exist.
/// Delta: the planned rules are not exactly what is there, compared in canonical form
/// ([`super::canon`]): per Istio chain the same rules (as multisets), no extra Istio chain,
/// every planned built-in-chain rule present, no other jump into an Istio chain.
pub fn verify_state(saved: &SavedState, plan: &[Rule]) -> (bool, bool) {
    let residue = saved.has_istio();
    if !residue {
        return (false, !plan.is_empty());
    }
    for table in Table::ALL {
        let t = table.name();
        let empty = BTreeMap::new();
        let have = saved.tables.get(t).unwrap_or(&empty);
        let planned: Vec<&Rule> = plan.iter().filter(|r| r.table == table).collect();
        let mut want: BTreeMap<&str, Vec<Vec<String>>> = BTreeMap::new();
        for r in &planned {
            want.entry(r.chain.as_str())
                .or_default()
                .push(canon_rule(r));
        }
        for (chain, rules) in &mut want {
            rules.sort();
            let mut got: Vec<Vec<String>> = have
                .get(*chain)
                .map(|specs| {
                    specs
                        .iter()
                        .map(|s| super::canon::canon(&tokens(s)))
                        .collect()
                })
                .unwrap_or_default();
            if is_builtin(chain) {
                // Built-in chains hold other software's rules too: ours must all be there,
                // and nothing else may jump into an Istio chain.
                for r in rules.iter() {
                    match got.iter().position(|g| g == r) {
                        Some(i) => {
                            got.swap_remove(i);
                        }
                        None => return (true, true),
                    }
                }
                let stray_jump = have.get(*chain).is_some_and(|specs| {
                    specs.iter().filter(|s| jumps_to_istio(s)).count()
                        != rules
                            .iter()
                            .filter(|r| r.iter().any(|t| t.starts_with("ISTIO_")))
                            .count()
                });
                if stray_jump {
                    return (true, true);
                }
            } else {
                got.sort();
                if got != *rules {
                    return (true, true);
                }
            }
        }
        // Istio chains we would not create, or built-in jumps from chains we leave alone.
        if saved
            .istio_chains(t)
            .iter()
            .any(|c| !want.contains_key(c.as_str()))
        {
            return (true, true);
        }
        if saved
            .istio_jumps(t)
            .iter()
            .any(|(c, _)| !want.contains_key(c.as_str()))
        {
            return (true, true);
        }
    }
    (true, false)
}

/// `iptables-restore --noflush` input removing every Istio chain and jump found in `saved`,
/// plus the built-in-chain rules of `candidates` that are present (matched canonically and
/// deleted with the spelling iptables-save printed).
pub fn cleanup_text(saved: &SavedState, candidates: &[Rule]) -> String {
    let mut out = String::new();
    for (t, chains) in &saved.tables {
        let mut lines = Vec::new();
        for (chain, specs) in chains.iter().filter(|(c, _)| is_builtin(c)) {
            let mut ours: Vec<Vec<String>> = candidates
                .iter()
                .filter(|r| r.table.name() == t && &r.chain == chain)
                .map(canon_rule)
                .collect();
            for spec in specs {
                let c = super::canon::canon(&tokens(spec));
                let pos = ours.iter().position(|o| *o == c);
                if let Some(i) = pos {
                    ours.swap_remove(i);
                }
                if pos.is_some() || jumps_to_istio(spec) {
                    lines.push(format!("-D {chain} {spec}"));
                }
            }
        }
        let istio = saved.istio_chains(t);
        lines.extend(istio.iter().map(|c| format!("-F {c}")));
        lines.extend(istio.iter().map(|c| format!("-X {c}")));
        if !lines.is_empty() {
            out.push_str(&format!("* {t}\n{}\nCOMMIT\n", lines.join("\n")));
        }
    }
    out
}

/// Istio builder `BuildGuardrails`: drop TCP/UDP while rules are replaced on reconcile.
fn guardrails(add: bool) -> String {
    let op = if add { "-I" } else { "-D" };
    let pos = if add { " 1" } else { "" };
    let mut s = String::from("* filter\n");
    for chain in ["INPUT", "OUTPUT"] {
        for proto in ["tcp", "udp"] {
            s.push_str(&format!("{op} {chain}{pos} -p {proto} -j DROP\n"));
        }
    }
    s.push_str("COMMIT\n");
    s
}

fn restore(sys: &mut System, bin: &Binaries, input: &str) -> Result<(), ApplyError> {
    let mut args = vec!["--noflush"];
    if bin.wait {
        args.push("--wait=30");
    }
    sys.run(&bin.restore, &args, Some(input)).map(|_| ())
}

/// What one family's run did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct FamilyOutcome {
    pub residue: bool,
    pub delta: bool,
    pub cleaned: bool,
    pub applied: bool,
}

impl FamilyOutcome {
    /// One line per family with each outcome as its own key (`applied=true`), so log
    /// pipelines can match on it; the `Debug` form of the struct is not a log format.
    fn log(self, family: &str, restore: &str) {
        tracing::info!(
            restore,
            residue = self.residue,
            delta = self.delta,
            cleaned = self.cleaned,
            applied = self.applied,
            "{family} rules done"
        );
    }
}

/// Istio capture/run.go `executeCommands` for one family.
pub fn apply_family(
    sys: &mut System,
    cfg: &Config,
    bin: &Binaries,
    plan: &[Rule],
    candidates: &[Rule],
    saved: &SavedState,
) -> Result<FamilyOutcome, ApplyError> {
    let (residue, delta) = if sys.dry_run {
        (false, true)
    } else {
        verify_state(saved, plan)
    };
    let mut outcome = FamilyOutcome {
        residue,
        delta,
        ..Default::default()
    };
    if residue && delta && !cfg.reconcile && !cfg.cleanup_only {
        tracing::info!(
            "reconcile is recommended but no-reconcile flag is set. Unexpected behavior may occur due to preexisting iptables rules"
        );
    }
    // `--force-apply` over existing Istio state replaces it the same way: re-adding the
    // chains on top of themselves would fail ("Chain already exists").
    let reconcile = residue && ((delta && cfg.reconcile) || cfg.force_apply) && !cfg.cleanup_only;
    if reconcile {
        tracing::info!("Setting up guardrails");
        let _ = restore(sys, bin, &guardrails(false));
        restore(sys, bin, &guardrails(true))?;
    }
    let result = (|| {
        if reconcile || cfg.cleanup_only {
            tracing::info!("Performing cleanup of existing iptables");
            let text = cleanup_text(saved, candidates);
            if !text.is_empty() {
                restore(sys, bin, &text)?;
                outcome.cleaned = true;
            }
        }
        if (delta || cfg.force_apply) && !cfg.cleanup_only && !plan.is_empty() {
            tracing::info!("Applying iptables chains and rules");
            let text = rules::restore_text(plan);
            tracing::info!(
                "Running {} --noflush with the following input:\n{}",
                bin.restore,
                text.trim()
            );
            restore(sys, bin, &text)?;
            outcome.applied = true;
        } else if !cfg.cleanup_only {
            tracing::info!("iptables state already matches the planned rules; nothing to apply");
        }
        Ok(())
    })();
    if reconcile {
        tracing::info!("Removing guardrails");
        let _ = restore(sys, bin, &guardrails(false));
    }
    result.map(|()| outcome)
}

/// Runs the iptables backend for both families.
pub fn apply_iptables(sys: &mut System, cfg: &Config, plan: &RuleSet) -> Result<(), ApplyError> {
    let v4 = detect_binaries(sys, cfg.force_binary, false)?;
    let v6 = if cfg.enable_ipv6 {
        Some(detect_binaries(sys, cfg.force_binary, true)?)
    } else {
        None
    };
    // Both states first, as Istio's `VerifyIptablesState` reads them; in an empty namespace
    // (a fresh pod) there is nothing to read and the two processes are skipped.
    let empty = !sys.dry_run && super::netlink::namespace_is_empty();
    let mut read = |bin: &Binaries| -> Result<SavedState, ApplyError> {
        if empty {
            return Ok(SavedState::default());
        }
        Ok(SavedState::parse(&sys.run(&bin.save, &[], None)?.stdout))
    };
    let saved4 = read(&v4)?;
    let saved6 = match &v6 {
        Some(v6) => Some(read(v6)?),
        None => None,
    };
    // Istio's dry run reads both families' state whatever the config (`VerifyIptablesState`
    // in capture/helper.go, with the stub's plain binary names).
    if sys.dry_run {
        sys.record
            .extend(["iptables-save".into(), "ip6tables-save".into()]);
    }
    if empty {
        tracing::info!("no iptables or nftables state in this namespace: nothing to reconcile");
    }
    let o4 = apply_family(
        sys,
        cfg,
        &v4,
        &plan.v4,
        &cleanup_candidates(cfg, false),
        &saved4,
    )?;
    o4.log("IPv4", &v4.restore);
    if let (Some(v6), Some(saved6)) = (&v6, &saved6) {
        let o6 = apply_family(
            sys,
            cfg,
            v6,
            &plan.v6,
            &cleanup_candidates(cfg, true),
            saved6,
        )?;
        o6.log("IPv6", &v6.restore);
    }
    // ... and the final state, per family applied (capture/run.go `Run`'s deferred log).
    if sys.dry_run {
        sys.record.push("iptables-save".into());
        if v6.is_some() {
            sys.record.push("ip6tables-save".into());
        }
    }
    // Istio logs the final state; that is one more process per family, so only at debug.
    if tracing::enabled!(tracing::Level::DEBUG) && !sys.dry_run {
        for bin in std::iter::once(&v4).chain(v6.as_ref()) {
            if let Ok(out) = sys.run(&bin.save, &[], None) {
                tracing::debug!("Final iptables state ({}):\n{}", bin.save, out.stdout);
            }
        }
    }
    Ok(())
}

/// Runs the native nftables backend: one `nft -f -` transaction.
pub fn apply_nft(sys: &mut System, text: &str) -> Result<(), ApplyError> {
    if !sys.dry_run && in_path("nft").is_none() {
        return Err(ApplyError::NftMissing { path: path_var() });
    }
    tracing::info!(
        "Running nft -f - with the following input:\n{}",
        text.trim()
    );
    sys.run("nft", &["-f", "-"], Some(text)).map(|_| ())
}

/// Istio `ConfigureRoutes` + `configureIPv6Addresses`: TPROXY policy routing (marked packets
/// are delivered locally) and `::6/128` on lo for IPv6. Existing entries are fine.
pub fn configure_routes(sys: &mut System, cfg: &Config) -> Result<(), ApplyError> {
    if cfg.enable_ipv6 {
        if sys.dry_run {
            sys.run("ip", &["-6", "addr", "add", "::6/128", "dev", "lo"], None)?;
        } else {
            super::netlink::add_ipv6_passthrough_address().map_err(ApplyError::Netlink)?;
        }
    }
    if cfg.mode != InterceptionMode::Tproxy || cfg.cleanup_only {
        return Ok(());
    }
    let mark = cfg.tproxy_mark.to_string();
    let table = cfg.tproxy_route_table.to_string();
    let families: &[&str] = if cfg.enable_ipv6 {
        &["-4", "-6"]
    } else {
        &["-4"]
    };
    for fam in families {
        if !rule_present(sys, fam, &mark, &table) {
            ignore_exists(sys.run(
                "ip",
                &[fam, "rule", "add", "fwmark", &mark, "lookup", &table],
                None,
            ))?;
        }
        ignore_exists(sys.run(
            "ip",
            &[
                fam, "route", "add", "local", "default", "dev", "lo", "table", &table,
            ],
            None,
        ))?;
    }
    Ok(())
}

/// `--cleanup-only`: the TPROXY policy route, if it is ours.
pub fn cleanup_routes(sys: &mut System, cfg: &Config) {
    let mark = cfg.tproxy_mark.to_string();
    let table = cfg.tproxy_route_table.to_string();
    for fam in ["-4", "-6"] {
        while rule_present(sys, fam, &mark, &table) {
            if sys
                .run(
                    "ip",
                    &[fam, "rule", "del", "fwmark", &mark, "lookup", &table],
                    None,
                )
                .is_err()
            {
                break;
            }
        }
        let _ = sys.run("ip", &[fam, "route", "flush", "table", &table], None);
    }
}

fn rule_present(sys: &mut System, fam: &str, mark: &str, table: &str) -> bool {
    if sys.dry_run {
        return false;
    }
    let hex = format!("0x{:x}", mark.parse::<u32>().unwrap_or(0));
    sys.run("ip", &[fam, "rule", "show"], None).is_ok_and(|o| {
        o.stdout.lines().any(|l| {
            let l = l.split_whitespace().collect::<Vec<_>>();
            l.windows(2)
                .any(|w| w[0] == "fwmark" && (w[1] == hex || w[1] == mark))
                && l.windows(2).any(|w| w[0] == "lookup" && w[1] == table)
        })
    })
}

fn ignore_exists(r: Result<Output, ApplyError>) -> Result<(), ApplyError> {
    match r {
        Ok(_) => Ok(()),
        Err(ApplyError::Failed { stderr, .. }) if stderr.to_lowercase().contains("file exists") => {
            Ok(())
        }
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_save_output() {
        let save = "# Generated\n*nat\n:PREROUTING ACCEPT [0:0]\n:ISTIO_INBOUND - [0:0]\n\
                    -A PREROUTING -p tcp -j ISTIO_INBOUND\n-A ISTIO_INBOUND -p tcp -m tcp --dport 15008 -j RETURN\nCOMMIT\n";
        let s = SavedState::parse(save);
        assert!(s.has_istio());
        assert_eq!(s.istio_chains("nat"), vec!["ISTIO_INBOUND"]);
        assert_eq!(
            s.istio_jumps("nat"),
            vec![("PREROUTING".into(), "-p tcp -j ISTIO_INBOUND".into())]
        );
        assert!(!SavedState::parse("*nat\n:PREROUTING ACCEPT [0:0]\nCOMMIT\n").has_istio());
    }

    #[test]
    fn dry_run_records_commands() {
        let mut sys = System::new(true);
        let cfg = Config::default();
        let plan = rules::build(&cfg);
        apply_iptables(&mut sys, &cfg, &plan).unwrap();
        assert!(
            sys.transcript
                .starts_with("iptables-save\niptables-restore --noflush --wait=30\n* nat\n"),
            "{}",
            sys.transcript
        );
        // Istio's stub record: both saves, the restore input alone, the final save.
        let restore = rules::restore_text(&plan.v4);
        let mut want = vec!["iptables-save".to_owned(), "ip6tables-save".to_owned()];
        want.extend(restore.lines().map(str::to_owned));
        want.push("iptables-save".to_owned());
        assert_eq!(sys.record, want);
    }
}
