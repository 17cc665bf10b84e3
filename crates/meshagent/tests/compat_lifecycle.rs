//! Differential: how the agent process ends, the real pilot-agent beside meshagent, each as a
//! pod runs it against istiod-box with a real Envoy (testkit `start_agent`). Cases: SIGTERM
//! after ready, SIGTERM before the proxy was ever ready (istiod unreachable), `POST
//! /quitquitquit`, and Envoy killed under the agent. Compared: the agent's exit status, and
//! that its Envoy is gone when it exits. Where meshagent exits otherwise on purpose (COMPAT.md,
//! "Deliberate differences") the expected pair is written here with that row's reason; any
//! other difference fails.
//!
//! `invalid_values_fail_where_pilot_agent_fails`: values that cannot work, each given to both
//! agents: where each fails (refuses to start, runs not ready with the error logged, or
//! exits when Envoy refuses to start), its exit status, and that meshagent's message lists
//! the values that work.
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::process::ExitStatus;
use std::time::Duration;

use meshagent_testkit::istiod_box::{
    AgentKind, IstiodBox, PodSpec, mesh_with_free_ports, start_agent, start_agent_with_args,
    workload_a,
};
use meshagent_testkit::{
    Proc, Sidecar, alive, envoy_children_of, free_port, http, http_get, json, signal, wait_for,
};

const READY: Duration = Duration::from_secs(60);

#[derive(Clone, Copy, Debug)]
enum Case {
    SigtermAfterReady,
    SigtermNeverReady,
    QuitQuitQuit,
    EnvoyKilled,
}

async fn wait_exit(p: &mut Proc, within: Duration) -> ExitStatus {
    wait_for(&format!("{} to exit", p.name), within, || {
        let s = p.try_wait();
        async move { s }
    })
    .await
}

async fn wait_ready(sc: &Sidecar) {
    wait_for("the agent to be ready", READY, || async {
        matches!(http_get(sc.status, "/healthz/ready").await, Ok((200, _))).then_some(())
    })
    .await;
}

/// Runs `case` with `kind`; returns the agent's exit status.
async fn run(istiod: &IstiodBox, kind: AgentKind, case: Case) -> ExitStatus {
    // Never ready: istiod's address is a closed port, so Envoy gets no configuration.
    let pc = match case {
        Case::SigtermNeverReady => {
            json!({"discoveryAddress": format!("localhost:{}", free_port())})
        }
        _ => json!({}),
    };
    let pod = PodSpec {
        proxy_config: pc,
        ..PodSpec::new("a", "127.0.0.1")
    };
    let mut sc = start_agent(istiod, kind, &pod).await;
    let pid = sc.proc.pid();
    let envoy = wait_for("the agent to start Envoy", READY, || {
        let c = envoy_children_of(pid);
        async move { (c.len() == 1).then(|| c[0]) }
    })
    .await;
    match case {
        Case::SigtermNeverReady => {
            // Give it time to try (and fail) to become ready, as a pod deleted while starting.
            wait_for("a readiness answer", READY, || async {
                matches!(http_get(sc.status, "/healthz/ready").await, Ok((503, _))).then_some(())
            })
            .await;
            signal(pid, "-TERM");
        }
        Case::SigtermAfterReady => {
            wait_ready(&sc).await;
            signal(pid, "-TERM");
        }
        Case::QuitQuitQuit => {
            wait_ready(&sc).await;
            match (kind, http("POST", sc.status, "/quitquitquit").await) {
                (_, Ok((code, body))) => assert_eq!(code, 200, "{kind:?} /quitquitquit: {body}"),
                // pilot-agent's handler signals the exit before it writes the answer, and
                // with the drain skipped (pkg/envoy/agent.go, terminate) the process may be
                // gone before the answer is: the connection then closes without one.
                // meshagent answers first (COMPAT.md).
                (AgentKind::PilotAgent, Err(e)) => eprintln!("pilot-agent /quitquitquit: {e}"),
                (AgentKind::Meshagent, Err(e)) => panic!("meshagent /quitquitquit: {e}"),
            }
        }
        Case::EnvoyKilled => {
            wait_ready(&sc).await;
            signal(envoy, "-KILL");
        }
    }
    // terminationDrainDuration is 2 s (start_agent); then Envoy's stop and the exit.
    let st = wait_exit(&mut sc.proc, Duration::from_secs(30)).await;
    assert!(
        !alive(envoy),
        "{kind:?} {case:?}: Envoy {envoy} outlived its agent\n{}",
        sc.proc.log_text()
    );
    st
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exit_statuses_match_pilot_agent() {
    let mesh = mesh_with_free_ports();
    let istiod = IstiodBox::start_with(&workload_a(), Some(&mesh), &[]).await;
    let mut failures = Vec::new();
    for case in [
        Case::SigtermAfterReady,
        Case::SigtermNeverReady,
        Case::QuitQuitQuit,
        Case::EnvoyKilled,
    ] {
        let pilot = run(&istiod, AgentKind::PilotAgent, case).await;
        let ours = run(&istiod, AgentKind::Meshagent, case).await;
        let (p, m) = (pilot.code(), ours.code());
        // The deliberate differences of COMPAT.md, as (pilot-agent, meshagent).
        let expected = match case {
            // "SIGTERM before the proxy was ever ready": drained, then exit 1, so a pod with
            // restartPolicy OnFailure whose holdApplicationUntilProxyStarts hook timed out is
            // retried.
            Case::SigtermNeverReady => (p, Some(1)),
            // "Envoy exits by itself": the agent exits with Envoy's status, 128 + 9.
            Case::EnvoyKilled => (p, Some(137)),
            _ => (p, p),
        };
        eprintln!("{case:?}: pilot-agent {p:?}, meshagent {m:?}");
        if (p, m) != expected {
            failures.push(format!(
                "{case:?}: pilot-agent {p:?}, meshagent {m:?}, expected meshagent {:?}",
                expected.1
            ));
        }
        // The listed differences hold only where Istio does what COMPAT.md says it does.
        match case {
            Case::SigtermNeverReady | Case::EnvoyKilled if p != Some(0) => failures.push(format!(
                "{case:?}: COMPAT.md says pilot-agent exits 0, it exited {p:?}: update the row"
            )),
            _ => {}
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Where an agent given a bad value ended up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    /// Ready (the value was taken as something that works).
    Ready,
    /// Still running and not ready (503) after logging the failure: it fails where the value
    /// is used, and keeps trying.
    RunningNotReady,
    /// Exited before Envoy was started, with this status.
    RefusedToStart(Option<i32>),
    /// Started Envoy, which refused the value and exited; then the agent, with this status.
    EnvoyRefused(Option<i32>),
}

struct BadValue {
    name: &'static str,
    env: &'static [(&'static str, &'static str)],
    args: &'static [&'static str],
    /// What each agent logs when it fails where the value is used (`RunningNotReady`):
    /// (pilot-agent, meshagent).
    failure: (&'static str, &'static str),
    /// What meshagent's log must say: the values that work.
    lists: &'static str,
    /// What meshagent's log must not say.
    not: &'static str,
}

const BAD_VALUES: &[BadValue] = &[
    BadValue {
        name: "PILOT_CERT_PROVIDER=foo",
        env: &[("PILOT_CERT_PROVIDER", "foo")],
        args: &[],
        failure: ("", ""),
        lists: "is not one of istiod, kubernetes, k8s.io/<signer>, custom, none",
        not: "",
    },
    BadValue {
        name: "ECC_SIGNATURE_ALGORITHM=FOO",
        env: &[("ECC_SIGNATURE_ALGORITHM", "FOO")],
        args: &[],
        failure: (
            "unsupported EC signature algorithm",
            "unsupported ECC_SIGNATURE_ALGORITHM \"FOO\"",
        ),
        lists: "expected ECDSA, or unset for RSA keys",
        not: "",
    },
    BadValue {
        name: "--proxyLogLevel=verbose",
        env: &[],
        args: &["--proxyLogLevel=verbose"],
        failure: ("", ""),
        lists: "(expected trace, debug, info, warning, warn, error, critical, off)",
        not: "",
    },
    BadValue {
        name: "ISTIO_META_DNS_CAPTURE=maybe",
        env: &[("ISTIO_META_DNS_CAPTURE", "maybe")],
        args: &[],
        failure: ("", ""),
        lists: "expected \"true\" or \"false\"",
        // pilot-agent warns so, then fails on the same value.
        not: "defaulting to false",
    },
    BadValue {
        name: "WORKLOAD_RSA_KEY_SIZE=1024",
        env: &[("WORKLOAD_RSA_KEY_SIZE", "1024")],
        args: &[],
        failure: (
            "requested key size does not meet the minimum required size of 2048",
            "",
        ),
        lists: "expected 2048, 3072 or 4096",
        not: "",
    },
];

/// Envoy's own refusal of a log level (both agents pass the flag on unchecked).
const ENVOY_REFUSED: &str = "invalid log level specified";

async fn run_bad_value(istiod: &IstiodBox, kind: AgentKind, v: &BadValue) -> (Outcome, String) {
    let pod = PodSpec {
        env: v.env,
        ..PodSpec::new("a", "127.0.0.1")
    };
    let mut sc = start_agent_with_args(istiod, kind, &pod, v.args).await;
    let failure = match kind {
        AgentKind::PilotAgent => v.failure.0,
        AgentKind::Meshagent => v.failure.1,
    };
    let outcome = wait_for(&format!("{kind:?} {}: an outcome", v.name), READY, || {
        let exited = sc.proc.try_wait();
        let log = sc.proc.log_text();
        let status = sc.status;
        async move {
            if let Some(st) = exited {
                return Some(if log.contains(ENVOY_REFUSED) {
                    Outcome::EnvoyRefused(st.code())
                } else {
                    Outcome::RefusedToStart(st.code())
                });
            }
            let ready = http_get(status, "/healthz/ready").await;
            match ready {
                Ok((200, _)) => Some(Outcome::Ready),
                Ok((503, _)) if !failure.is_empty() && log.contains(failure) => {
                    Some(Outcome::RunningNotReady)
                }
                _ => None,
            }
        }
    })
    .await;
    if outcome == Outcome::RunningNotReady {
        // Still failing, and still running, a while later: it keeps trying, as Istio does.
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(sc.proc.try_wait().is_none(), "{kind:?} {}: exited", v.name);
        let (code, body) = http_get(sc.status, "/healthz/ready").await.unwrap();
        assert_eq!(code, 503, "{kind:?} {}: {body}", v.name);
    }
    if let Outcome::RefusedToStart(_) = outcome {
        let log = sc.proc.log_text();
        for envoy_started in ["starting Envoy", "Envoy command:"] {
            assert!(
                !log.contains(envoy_started),
                "{kind:?} {}: Envoy was started:\n{log}",
                v.name
            );
        }
    }
    (outcome, sc.proc.log_text())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_values_fail_where_pilot_agent_fails() {
    let mesh = mesh_with_free_ports();
    let istiod = IstiodBox::start_with(&workload_a(), Some(&mesh), &[]).await;
    let mut failures = Vec::new();
    for v in BAD_VALUES {
        let (p, _) = run_bad_value(&istiod, AgentKind::PilotAgent, v).await;
        let (m, log) = run_bad_value(&istiod, AgentKind::Meshagent, v).await;
        eprintln!("{}: pilot-agent {p:?}, meshagent {m:?}", v.name);
        // The deliberate differences of COMPAT.md, as (pilot-agent, meshagent).
        let expected = match (v.name, p) {
            // "a failed command": exit 1 where Istio's cobra exits 255.
            (_, Outcome::RefusedToStart(Some(255))) => (p, Outcome::RefusedToStart(Some(1))),
            // "Envoy exits by itself": the agent exits with Envoy's status.
            (_, Outcome::EnvoyRefused(Some(0))) => (p, Outcome::EnvoyRefused(Some(1))),
            // "WORKLOAD_RSA_KEY_SIZE other than 2048, 3072, 4096": refused at start.
            ("WORKLOAD_RSA_KEY_SIZE=1024", Outcome::RunningNotReady) => {
                (p, Outcome::RefusedToStart(Some(1)))
            }
            _ => (p, p),
        };
        if (p, m) != expected {
            failures.push(format!(
                "{}: pilot-agent {p:?}, meshagent {m:?}, expected meshagent {:?}",
                v.name, expected.1
            ));
        }
        if !log.contains(v.lists) {
            failures.push(format!(
                "{}: meshagent's log does not list the values that work ({:?}):\n{log}",
                v.name, v.lists
            ));
        }
        if !v.not.is_empty() && log.contains(v.not) {
            failures.push(format!("{}: meshagent logged {:?}:\n{log}", v.name, v.not));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
