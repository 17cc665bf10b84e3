//! Capture backend consistency: which backend holds Istio's rules in this network namespace.
//!
//! `istio-init` (or istio-cni) installs either iptables rules in `ISTIO_*` chains
//! (`tools/istio-iptables`) or, with `values.global.nativeNftables`, the `inet istio-proxy-*`
//! tables (`tools/istio-nftables`). Field failures come from the two disagreeing: rules of both
//! backends at once, rules of neither, or the binary of the configured backend missing from the
//! image (Istio #57978, #61019, #52357). The state is read with the same `*-save` parser the
//! `istio-iptables` command uses to reconcile ([`crate::iptables::apply::SavedState`]).

use std::process::Stdio;

use tokio::io::AsyncReadExt;

use super::{Check, DoctorError, Options};
use crate::config::{Config, InterceptionMode, ProxyType};
use crate::iptables::apply::{SavedState, in_path};
use crate::iptables::nft::NftTable;

const NAME: &str = "capture";
/// `*-save` output of a pod is a few KiB; a namespace with huge foreign rule sets is cut here.
const MAX_OUTPUT: u64 = 16 << 20;

/// What one backend's binary said.
#[derive(Debug)]
struct Probe {
    /// e.g. `iptables-legacy`, `nftables`.
    backend: &'static str,
    /// The binary that was run, or `None` when none of its binaries is installed.
    result: Option<Result<bool, DoctorError>>,
}

/// Runs `cmd args` with a deadline and bounded output; stdout on success.
pub(crate) async fn run_cmd(
    cmd: &str,
    args: &[&str],
    opts: &Options,
) -> Result<String, DoctorError> {
    let shown = format!("{cmd} {}", args.join(" ")).trim_end().to_owned();
    let mut child = tokio::process::Command::new(cmd)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|error| DoctorError::Spawn {
            cmd: shown.clone(),
            error,
        })?;
    let (Some(out), Some(err)) = (child.stdout.take(), child.stderr.take()) else {
        return Err(DoctorError::Invalid(format!("{shown}: no output pipes")));
    };
    let work = async {
        let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
        let (mut out, mut err) = (out.take(MAX_OUTPUT), err.take(64 << 10));
        let (a, b) = tokio::join!(out.read_to_end(&mut stdout), err.read_to_end(&mut stderr));
        a.and(b).map_err(|error| DoctorError::Spawn {
            cmd: shown.clone(),
            error,
        })?;
        let status = child.wait().await.map_err(|error| DoctorError::Spawn {
            cmd: shown.clone(),
            error,
        })?;
        if !status.success() {
            return Err(DoctorError::Command {
                cmd: shown.clone(),
                status: status.to_string(),
                stderr: String::from_utf8_lossy(&stderr).trim().to_owned(),
            });
        }
        Ok(String::from_utf8_lossy(&stdout).into_owned())
    };
    tokio::time::timeout(opts.step_timeout, work)
        .await
        .unwrap_or(Err(DoctorError::Timeout(opts.step_timeout)))
}

/// Istio state in the iptables rules of one flavour (IPv4 and IPv6 `*-save`).
async fn iptables(flavour: Option<&'static str>, opts: &Options) -> Probe {
    let backend = match flavour {
        Some("legacy") => "iptables-legacy",
        Some(_) => "iptables-nft",
        None => "iptables",
    };
    let mut ran = false;
    let mut found = false;
    for base in ["iptables", "ip6tables"] {
        let save = match flavour {
            Some(f) => format!("{base}-{f}-save"),
            None => format!("{base}-save"),
        };
        if in_path(&save).is_none() {
            continue;
        }
        ran = true;
        match run_cmd(&save, &[], opts).await {
            Ok(text) => found |= SavedState::parse(&text).has_istio(),
            Err(e) => {
                return Probe {
                    backend,
                    result: Some(Err(e)),
                };
            }
        }
    }
    Probe {
        backend,
        result: ran.then_some(Ok(found)),
    }
}

/// Whether the native nftables tables (`inet istio-proxy-nat` …) exist.
async fn nftables(opts: &Options) -> Probe {
    if in_path("nft").is_none() {
        return Probe {
            backend: "nftables",
            result: None,
        };
    }
    let result = run_cmd("nft", &["list", "tables"], opts).await.map(|text| {
        text.lines().any(|l| {
            let mut w = l.split_whitespace();
            w.next() == Some("table")
                && w.next() == Some("inet")
                && w.next()
                    .is_some_and(|t| NftTable::ALL.iter().any(|n| n.name() == t))
        })
    });
    Probe {
        backend: "nftables",
        result: Some(result),
    }
}

/// The `capture` finding.
pub async fn check(cfg: &Config, opts: &Options) -> Vec<Check> {
    if cfg.proxy_type != ProxyType::Sidecar {
        return vec![Check::ok(
            NAME,
            format!("proxy type {}: no traffic capture expected", cfg.proxy_type),
        )];
    }
    if cfg.proxy_config.interception_mode == InterceptionMode::None {
        return vec![Check::ok(
            NAME,
            "interceptionMode NONE: no traffic capture expected",
        )];
    }
    // Both flavours are read when installed: a netns can hold legacy and nf_tables rules at
    // once (Istio #52357), and plain `iptables-save` shows only the one it is linked to.
    let mut probes = vec![
        iptables(Some("legacy"), opts).await,
        iptables(Some("nft"), opts).await,
    ];
    if probes.iter().all(|p| p.result.is_none()) {
        probes.push(iptables(None, opts).await);
    }
    probes.push(nftables(opts).await);
    vec![judge(&probes)]
}

fn judge(probes: &[Probe]) -> Check {
    let found: Vec<&str> = probes
        .iter()
        .filter(|p| matches!(p.result, Some(Ok(true))))
        .map(|p| p.backend)
        .collect();
    let errors: Vec<String> = probes
        .iter()
        .filter_map(|p| match &p.result {
            Some(Err(e)) => Some(e.to_string()),
            _ => None,
        })
        .collect();
    let nft_missing = probes
        .iter()
        .any(|p| p.backend == "nftables" && p.result.is_none());
    let iptables_missing = probes
        .iter()
        .filter(|p| p.backend != "nftables")
        .all(|p| p.result.is_none());
    let native = found.contains(&"nftables");
    match found.as_slice() {
        [one] => Check::ok(
            NAME,
            format!(
                "Istio's rules are installed by one backend only: {one}{}{}",
                if native {
                    " (tables inet istio-proxy-*)"
                } else {
                    " (ISTIO_* chains)"
                },
                if errors.is_empty() {
                    String::new()
                } else {
                    format!("; not read: {}", errors.join("; "))
                }
            ),
        ),
        [_, _, ..] => Check::fail(
            NAME,
            format!(
                "Istio's rules are installed by more than one backend: {} — packets meet both \
                 rule sets and may be redirected twice or not at all",
                found.join(" and ")
            ),
            "make one backend own capture: set values.global.nativeNftables the same for \
             istio-init/istio-cni and the proxy image, delete the stale rules (iptables -t nat \
             -F/-X of the ISTIO_* chains, or `nft delete table inet istio-proxy-nat` and the \
             mangle/raw tables), then restart the pod",
        ),
        [] if iptables_missing && nft_missing => Check::fail(
            NAME,
            "cannot read capture rules: neither iptables-save (legacy or nft) nor nft is in PATH",
            "use a proxy image with iptables and nftables (Istio's proxyv2 has both); with \
             native nftables the nft binary must be in the image (Istio #57978)",
        ),
        [] if !errors.is_empty() => Check::warn(
            NAME,
            format!("cannot read capture rules: {}", errors.join("; ")),
            "reading rules needs CAP_NET_ADMIN: run the doctor as root in the pod's network \
             namespace, e.g. `nsenter -t <envoy pid> -n meshagent doctor` on the node",
        ),
        [] => {
            let mut detail = "no Istio capture rules in this network namespace (no ISTIO_* \
                              iptables chains, no inet istio-proxy-* nftables tables): traffic \
                              bypasses Envoy"
                .to_owned();
            let mut fix = "check that istio-init ran (`kubectl logs <pod> -c istio-init`) or that \
                           istio-cni is installed and ready on this node, then restart the pod"
                .to_owned();
            if nft_missing {
                detail.push_str(
                    "; nft is not installed, so native nftables rules were not looked for",
                );
                fix.push_str("; with values.global.nativeNftables the image needs the nft binary (Istio #57978)");
            } else if iptables_missing {
                detail.push_str(
                    "; no iptables-save is installed, so iptables rules were not looked for",
                );
                fix.push_str("; with iptables capture the image needs iptables-save");
            }
            Check::fail(NAME, detail, fix)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(backend: &'static str, r: Option<bool>) -> Probe {
        Probe {
            backend,
            result: r.map(Ok),
        }
    }

    #[test]
    fn verdicts() {
        let ok = judge(&[
            p("iptables-legacy", Some(false)),
            p("iptables-nft", Some(true)),
            p("nftables", Some(false)),
        ]);
        assert_eq!(ok.status, super::super::Status::Ok, "{ok:?}");
        let both = judge(&[p("iptables-nft", Some(true)), p("nftables", Some(true))]);
        assert_eq!(both.status, super::super::Status::Fail);
        assert!(
            both.detail.contains("iptables-nft and nftables"),
            "{both:?}"
        );
        let none = judge(&[p("iptables-nft", Some(false)), p("nftables", None)]);
        assert_eq!(none.status, super::super::Status::Fail);
        assert!(none.detail.contains("nft is not installed"), "{none:?}");
        let blind = judge(&[
            p("iptables-legacy", None),
            p("iptables-nft", None),
            p("iptables", None),
            p("nftables", None),
        ]);
        assert!(blind.detail.contains("neither"), "{blind:?}");
    }
}
