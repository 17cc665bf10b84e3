//! Differential: the Envoy bootstrap, Envoy's argv and the proxyless gRPC bootstrap of the real
//! pilot-agent (built from the Go module `istio.io/istio` pinned in `compat/go.sum`, `make
//! pilot-agent`) against meshagent's, for the same pod: environment, ProxyConfig
//! (`PROXY_CONFIG` and the `proxy.istio.io/config` annotation), downward-API files, flags and
//! templates.
//!
//! How: both agents start `proxy sidecar` (or `router`) with ProxyConfig `binaryPath` set to a
//! fake Envoy, a shell script that records its argv and copies the file `-c` names, then sleeps
//! until the agent's process group is killed. For the gRPC cases (`DISABLE_ENVOY=true`,
//! `GRPC_XDS_BOOTSTRAP`, Istio's `grpc-agent` template) the file the agent writes is read. Each
//! run has a fresh working directory (both agents resolve `./etc/istio/...`,
//! `./var/run/secrets/...` against it) holding the same files, and a network namespace of its
//! own that looks like a pod's (loopback, eth0 with 10.1.2.3 and fd00::3, or fd00::3 only for
//! an IPv6-only pod): the node's
//! `INSTANCE_IPS` and the local address family come from the interfaces, and every run can use
//! Istio's fixed ports (15000, 15020, 15053, 15090), so cases run in parallel. istiod is not
//! needed: pilot-agent starts Envoy while its CA requests still fail
//! (`pkg/istio-agent/agent.go`); it only needs a parseable root certificate to build its CA
//! client, and Istio's default template at `./var/lib/istio/envoy/envoy_bootstrap_tmpl.json`
//! (copied from the module cache by `make pilot-agent`, beside the binary).
//!
//! Compared: argv as a list; the bootstraps as `envoy.config.bootstrap.v3.Bootstrap` protos
//! (canonical proto-JSON, the golden suite's machinery) or, when a side is not a Bootstrap
//! (a custom template's YAML), as text; gRPC bootstraps as JSON. A difference that is not in
//! `KNOWN` fails, and so does a listed one that is gone. A missing pilot-agent is a failure,
//! never a skip.
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)]

mod bootstrap_support;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bootstrap_support::{as_bootstrap_proto, diff, envoy_descriptors};
use meshagent_testkit::Proc;
use meshagent_testkit::istiod_box::{istio_bootstrap_template, pilot_agent_bin as pilot_agent};
use serde_json::{Map, Value, json};
use tokio::time::Instant;

/// Run by `sh -c` in the new network namespace, then `exec "$@"` (as in compat_iptables).
const POD_NETNS: &str = "set -e; ip link set lo up; ip link add eth0 type veth peer name eth0p; \
    ip addr add 10.1.2.3/24 dev eth0; ip -6 addr add fd00::3/64 dev eth0 nodad; \
    ip link set eth0 up; ip link set eth0p up; exec \"$@\"";

/// An IPv6-only pod: eth0 with fd00::3 only.
const POD_NETNS_V6: &str = "set -e; ip link set lo up; ip link add eth0 type veth peer name eth0p; \
    ip -6 addr add fd00::3/64 dev eth0 nodad; ip link set eth0 up; ip link set eth0p up; exec \"$@\"";

/// The fake Envoy. Its working directory is the agent's (`<run>/work`), so it records into
/// `<run>/capture`: argv one argument a line, and a copy of the `-c` file. `argv` appears
/// (renamed) only once both are complete.
const FAKE_ENVOY: &str = r#"#!/bin/sh
out=../capture
prev=
for a in "$@"; do
  printf '%s\n' "$a" >> "$out/argv.tmp"
  if [ "$prev" = "-c" ]; then cp "$a" "$out/config"; fi
  prev=$a
done
mv "$out/argv.tmp" "$out/argv"
exec sleep 600
"#;

/// A case: the pod's environment on top of `BASE_ENV`, ProxyConfig fields (JSON, merged into
/// `PROXY_CONFIG` beside `binaryPath`), files under the working directory, the agent's
/// arguments.
struct Case {
    name: &'static str,
    args: &'static [&'static str],
    env: &'static [(&'static str, &'static str)],
    pc: &'static str,
    files: &'static [(&'static str, &'static str)],
    /// The pod's network namespace setup (`POD_NETNS` or `POD_NETNS_V6`).
    netns: &'static str,
}

const SIDECAR: &[&str] = &["proxy", "sidecar"];

const fn c(
    name: &'static str,
    env: &'static [(&'static str, &'static str)],
    pc: &'static str,
    files: &'static [(&'static str, &'static str)],
) -> Case {
    Case {
        name,
        args: SIDECAR,
        env,
        pc,
        files,
        netns: POD_NETNS,
    }
}

/// The case in an IPv6-only pod.
const fn ipv6_pod(mut case: Case) -> Case {
    case.netns = POD_NETNS_V6;
    case
}

const fn with_args(mut case: Case, args: &'static [&'static str]) -> Case {
    case.args = args;
    case
}

/// What Istio's sidecar injector sets on istio-proxy (its `sidecar` template), minus what a
/// case varies. `CLOUD_PLATFORM=none`: no platform metadata probes.
const BASE_ENV: &[(&str, &str)] = &[
    ("POD_NAME", "productpage-v1-6b7f6db5c4-x2x9z"),
    ("POD_NAMESPACE", "bookinfo"),
    ("INSTANCE_IP", "10.1.2.3"),
    ("SERVICE_ACCOUNT", "bookinfo-productpage"),
    ("HOST_IP", "192.168.7.7"),
    ("CLOUD_PLATFORM", "none"),
    ("PILOT_CERT_PROVIDER", "istiod"),
    ("CA_ADDR", "istiod.istio-system.svc:15012"),
    ("JWT_POLICY", "third-party-jwt"),
    ("ISTIO_CPU_LIMIT", "2"),
    (
        "ISTIO_META_POD_PORTS",
        r#"[{"name":"http","containerPort":9080,"protocol":"TCP"}]"#,
    ),
    ("ISTIO_META_APP_CONTAINERS", "productpage"),
    ("ISTIO_META_CLUSTER_ID", "Kubernetes"),
    ("ISTIO_META_NODE_NAME", "node-1"),
    ("ISTIO_META_INTERCEPTION_MODE", "REDIRECT"),
    ("ISTIO_META_WORKLOAD_NAME", "productpage-v1"),
    (
        "ISTIO_META_OWNER",
        "kubernetes://apis/apps/v1/namespaces/bookinfo/deployments/productpage-v1",
    ),
    ("ISTIO_META_MESH_ID", "cluster.local"),
    ("TRUST_DOMAIN", "cluster.local"),
];

/// Downward-API files as the injector mounts them (`key="value"` lines).
const POD_LABELS: &str = "app=\"productpage\"\nversion=\"v1\"\nsecurity.istio.io/tlsMode=\"istio\"\nservice.istio.io/canonical-name=\"productpage\"\nservice.istio.io/canonical-revision=\"v1\"\n";
const LABELS: &str = "./etc/istio/pod/labels";
/// A file's contents standing for the test's root certificate.
const ROOT_CERT: &str = "@root-cert";
const ANNOTATIONS: &str = "./etc/istio/pod/annotations";

/// A custom template using Istio's parameter names (`pkg/bootstrap/config.go`, `option/`).
const CUSTOM_TEMPLATE: &str = r#"{
  "node": {"id": "{{ .nodeID }}", "cluster": "{{ .cluster }}", "metadata": {{ .meta_json_str }}},
  "admin": {"address": {"socket_address": {"address": "{{ .localhost }}", "port_value": {{ .config.ProxyAdminPort }}}}},
  "dynamic_resources": {"ads_config": {"api_type": "{{ .xds_type }}", "transport_api_version": "V3",
    "grpc_services": [{"envoy_grpc": {"cluster_name": "xds-grpc"}}]}},
  "static_resources": {"clusters": [{"name": "xds-grpc", "type": "STATIC", "connect_timeout": "1s",
    "load_assignment": {"cluster_name": "xds-grpc", "endpoints": [{"lb_endpoints": [{"endpoint":
      {"address": {"pipe": {"path": "./etc/istio/proxy/XDS"}}}}]}]}}]}
}
"#;

const CASES: &[Case] = &[
    c("injected_sidecar", &[], "{}", &[(LABELS, POD_LABELS)]),
    c("no_downward_files", &[], "{}", &[]),
    with_args(
        c("router", &[], "{}", &[(LABELS, POD_LABELS)]),
        &["proxy", "router"],
    ),
    with_args(
        c("router_flags", &[], "{}", &[]),
        &[
            "proxy",
            "router",
            "--domain",
            "bookinfo.svc.cluster.local",
            "--serviceCluster",
            "gw",
        ],
    ),
    c("concurrency_pc", &[], r#"{"concurrency": 2}"#, &[]),
    with_args(
        c("concurrency_flag", &[], "{}", &[]),
        &["proxy", "sidecar", "--concurrency", "3"],
    ),
    c(
        "drain_durations",
        &[],
        r#"{"drainDuration": "12s", "terminationDrainDuration": "20s", "parentShutdownDuration": "30s"}"#,
        &[],
    ),
    with_args(
        c("log_levels", &[], "{}", &[]),
        &[
            "proxy",
            "sidecar",
            "--proxyLogLevel",
            "debug",
            "--proxyComponentLogLevel",
            "misc:error,upstream:debug",
        ],
    ),
    c(
        "ports_moved",
        &[],
        r#"{"proxyAdminPort": 25000, "statusPort": 25020}"#,
        &[],
    ),
    c(
        "tracing_zipkin",
        &[],
        r#"{"tracing": {"zipkin": {"address": "zipkin.istio-system:9411"}, "sampling": 42, "maxPathTagLength": 99}}"#,
        &[],
    ),
    c(
        "tracing_datadog",
        &[],
        r#"{"tracing": {"datadog": {"address": "$(HOST_IP):8126"}}}"#,
        &[],
    ),
    c(
        "tracing_lightstep",
        &[],
        r#"{"tracing": {"lightstep": {"address": "lightstep.example:443", "accessToken": "tok"}}}"#,
        &[],
    ),
    c(
        "tracing_opencensus",
        &[],
        r#"{"tracing": {"openCensusAgent": {"address": "oc:55678"}}}"#,
        &[],
    ),
    c("tracing_empty", &[], r#"{"tracing": {}}"#, &[]),
    c(
        "tracing_tls",
        &[],
        r#"{"tracing": {"zipkin": {"address": "zipkin:9411"}, "tlsSettings": {"mode": "SIMPLE", "caCertificates": "/etc/zipkin/ca.pem", "sni": "zipkin"}}}"#,
        &[],
    ),
    c(
        "stats_matcher_pc",
        &[],
        r#"{"proxyStatsMatcher": {"inclusionPrefixes": ["upstream_cx"], "inclusionSuffixes": ["rbac.allowed"], "inclusionRegexps": ["http.*rq_.*"]}}"#,
        &[],
    ),
    c(
        "stats_inclusion_annotations",
        &[],
        "{}",
        &[(
            ANNOTATIONS,
            "sidecar.istio.io/statsInclusionPrefixes=\"cluster.outbound,listener\"\nsidecar.istio.io/statsInclusionSuffixes=\"upstream_rq_timeout\"\nsidecar.istio.io/statsInclusionRegexps=\"http\\\\..*\"\n",
        )],
    ),
    c(
        "stats_compression_off",
        &[],
        r#"{"statsCompression": false}"#,
        &[],
    ),
    c(
        "extra_stat_tags",
        &[],
        r#"{"extraStatTags": ["dst_zone", "src_zone"]}"#,
        &[(
            ANNOTATIONS,
            "sidecar.istio.io/extraStatTags=\"a_tag,b_tag\"\n",
        )],
    ),
    c(
        "stats_intervals",
        &[],
        "{}",
        &[(
            ANNOTATIONS,
            "sidecar.istio.io/statsFlushInterval=\"10s\"\nsidecar.istio.io/statsEvictionInterval=\"60s\"\n",
        )],
    ),
    c(
        "stats_eviction_invalid",
        &[],
        "{}",
        &[(
            ANNOTATIONS,
            "sidecar.istio.io/statsFlushInterval=\"10s\"\nsidecar.istio.io/statsEvictionInterval=\"15s\"\n",
        )],
    ),
    c(
        "histogram_buckets",
        &[],
        "{}",
        &[(
            ANNOTATIONS,
            "sidecar.istio.io/statsHistogramBuckets=\"{\\\"istiocustom\\\":[1,5,10],\\\"cluster_manager\\\":[1,2]}\"\n",
        )],
    ),
    c(
        "annotation_proxy_config",
        &[],
        "{}",
        &[(
            ANNOTATIONS,
            "proxy.istio.io/config=\"concurrency: 4\\nproxyStatsMatcher:\\n  inclusionPrefixes: [\\\"tls_inspector\\\"]\\n\"\n",
        )],
    ),
    c(
        "proxy_metadata",
        &[],
        r#"{"proxyMetadata": {"ISTIO_META_DNS_CAPTURE": "true", "ISTIO_META_CUSTOM": "x", "BOOTSTRAP_XDS_AGENT": "true"}}"#,
        &[],
    ),
    c("ipv6", &[("INSTANCE_IP", "fd00::3")], "{}", &[]),
    c("dual_stack", &[("ISTIO_DUAL_STACK", "true")], "{}", &[]),
    ipv6_pod(c(
        "ipv6_only_pod",
        &[("INSTANCE_IP", "fd00::3")],
        r#"{"tracing": {"zipkin": {"address": "zipkin:9411"}}}"#,
        &[],
    )),
    ipv6_pod(c(
        "ipv6_only_pod_dual_stack_secure_metrics",
        &[
            ("INSTANCE_IP", "fd00::3"),
            ("ISTIO_DUAL_STACK", "true"),
            ("ENVOY_SECURE_METRICS_PORT", "15091"),
        ],
        "{}",
        &[],
    )),
    c(
        "dual_stack_ipv6_first",
        &[("ISTIO_DUAL_STACK", "true"), ("INSTANCE_IP", "fd00::3")],
        "{}",
        &[],
    ),
    c(
        "output_certs",
        &[("OUTPUT_CERTS", "./etc/istio-certs")],
        "{}",
        &[],
    ),
    c(
        "prov_cert",
        &[("PROV_CERT", "./etc/prov-certs")],
        "{}",
        &[("./etc/prov-certs/root-cert.pem", ROOT_CERT)],
    ),
    c(
        "self_discovery",
        &[("ISTIO_META_ENABLE_SELF_DISCOVERY", "true")],
        "{}",
        &[],
    ),
    c(
        "secure_metrics",
        &[("ENVOY_SECURE_METRICS_PORT", "15091")],
        "{}",
        &[],
    ),
    c(
        "secure_merged_metrics",
        &[
            ("ENVOY_SECURE_MERGED_METRICS_PORT", "15092"),
            ("ENVOY_SECURE_METRICS_PORT", "15091"),
        ],
        "{}",
        &[],
    ),
    c(
        "dns_capture",
        &[
            ("ISTIO_META_DNS_CAPTURE", "true"),
            ("ISTIO_META_DNS_AUTO_ALLOCATE", "true"),
        ],
        "{}",
        &[],
    ),
    c("delta_off", &[("ISTIO_DELTA_XDS", "false")], "{}", &[]),
    c(
        "plaintext_control_plane",
        &[("CA_ADDR", "istiod.istio-system.svc:15012")],
        r#"{"discoveryAddress": "istiod.istio-system.svc:15010", "controlPlaneAuthPolicy": "NONE"}"#,
        &[],
    ),
    c(
        "metrics_and_als",
        &[],
        r#"{"envoyMetricsService": {"address": "ms.example:15000"}, "envoyAccessLogService": {"address": "als.example:15001", "tlsSettings": {"mode": "SIMPLE", "caCertificates": "/etc/als/ca.pem"}}}"#,
        &[],
    ),
    c(
        "metrics_service_keepalive",
        &[],
        r#"{"envoyMetricsService": {"address": "ms.example:15000", "tcpKeepalive": {"probes": 3, "time": "5s", "interval": "2s"}}}"#,
        &[],
    ),
    c(
        "statsd",
        &[],
        r#"{"statsdUdpAddress": "10.9.9.9:8125"}"#,
        &[],
    ),
    c(
        "statsd_hostname",
        &[],
        r#"{"statsdUdpAddress": "statsd.example:8125"}"#,
        &[],
    ),
    c(
        "connection_limit",
        &[],
        r#"{"proxyMetadata": {"ISTIO_META_GLOBAL_DOWNSTREAM_MAX_CONNECTIONS": "12345"}}"#,
        &[],
    ),
    c(
        "locality_labels",
        &[],
        "{}",
        &[(
            LABELS,
            "app=\"productpage\"\ntopology.kubernetes.io/region=\"us-east1\"\ntopology.kubernetes.io/zone=\"us-east1-b\"\ntopology.istio.io/subzone=\"rack7\"\n",
        )],
    ),
    c(
        "locality_label_topology",
        &[],
        "{}",
        &[(
            LABELS,
            "app=\"productpage\"\ntopology.istio.io/locality=\"r1.z1.s1\"\nistio-locality=\"r2.z2\"\n",
        )],
    ),
    c(
        "locality_label_istio",
        &[],
        "{}",
        &[(
            LABELS,
            "app=\"productpage\"\nistio-locality=\"eu-west1.eu-west1-c.rack2\"\n",
        )],
    ),
    c(
        "metajson_and_network",
        &[
            ("ISTIO_METAJSON_EXTRA", r#"{"k1":"v1","nested":{"a":1}}"#),
            ("ISTIO_META_NETWORK", "net-1"),
            ("ISTIO_META_REQUESTED_NETWORK_VIEW", "net-1,net-2"),
        ],
        "{}",
        &[],
    ),
    c(
        "metajson_labels_locality",
        &[(
            "ISTIO_METAJSON_LABELS",
            r#"{"app":"ratings","istio-locality":"r3.z3.s3"}"#,
        )],
        "{}",
        &[],
    ),
    c(
        "bootstrap_override",
        &[(
            "ISTIO_BOOTSTRAP_OVERRIDE",
            "./etc/istio/custom-bootstrap/override.json",
        )],
        "{}",
        &[(
            "./etc/istio/custom-bootstrap/override.json",
            r#"{"stats_flush_interval": "7s"}"#,
        )],
    ),
    c(
        "custom_template_env",
        &[("ISTIO_BOOTSTRAP", "./custom/bootstrap.json")],
        "{}",
        &[("./custom/bootstrap.json", CUSTOM_TEMPLATE)],
    ),
    with_args(
        c(
            "custom_template_flag",
            &[],
            "{}",
            &[("./custom/bootstrap.json", CUSTOM_TEMPLATE)],
        ),
        &[
            "proxy",
            "sidecar",
            "--templateFile",
            "./custom/bootstrap.json",
        ],
    ),
    c(
        "custom_template_pc",
        &[],
        r#"{"proxyBootstrapTemplatePath": "./custom/bootstrap.json"}"#,
        &[("./custom/bootstrap.json", CUSTOM_TEMPLATE)],
    ),
    c(
        "istio_template_rendered",
        &[(
            "ISTIO_BOOTSTRAP",
            "./var/lib/istio/envoy/envoy_bootstrap_tmpl.json",
        )],
        r#"{"tracing": {"zipkin": {"address": "zipkin:9411"}}}"#,
        &[(LABELS, POD_LABELS)],
    ),
    with_args(
        c("outlier_log", &[], "{}", &[]),
        &["proxy", "sidecar", "--outlierLogPath", "/dev/stdout"],
    ),
    c(
        "file_flush",
        &[],
        r#"{"fileFlushInterval": "2s", "fileFlushMinSizeKb": 64}"#,
        &[],
    ),
    c(
        "proxy_protocol_health",
        &[("ENVOY_STATUS_PORT_ENABLE_PROXY_PROTOCOL", "true")],
        "{}",
        &[],
    ),
    c(
        "secure_metrics_dual_stack",
        &[
            ("ENVOY_SECURE_METRICS_PORT", "15091"),
            ("ISTIO_DUAL_STACK", "true"),
        ],
        "{}",
        &[],
    ),
    c(
        "load_stats",
        &[(
            "ISTIO_META_LOAD_STATS_CONFIG_JSON",
            r#"{"api_type":"GRPC","grpc_services":[{"envoy_grpc":{"cluster_name":"xds-grpc"}}]}"#,
        )],
        "{}",
        &[],
    ),
    c(
        "hbone_metadata_discovery",
        &[("ISTIO_META_ENABLE_HBONE", "true")],
        "{}",
        &[],
    ),
    c(
        "exit_on_zero_and_core_dump",
        &[
            ("EXIT_ON_ZERO_ACTIVE_CONNECTIONS", "true"),
            ("ISTIO_ENVOY_ENABLE_CORE_DUMP", "true"),
        ],
        "{}",
        &[],
    ),
    c(
        "metrics_localhost_only",
        &[],
        r#"{"proxyMetadata": {"METRICS_LOCALHOST_ACCESS_ONLY": "true"}}"#,
        &[],
    ),
    c(
        "runtime_values_and_limits",
        &[],
        r#"{"runtimeValues": {"overload.global_downstream_max_connections": "5000", "a.b": "c"}}"#,
        &[],
    ),
    c(
        "tracing_service_name",
        &[],
        r#"{"tracingServiceName": "CANONICAL_NAME_AND_NAMESPACE", "tracing": {"zipkin": {"address": "zipkin:9411"}}}"#,
        &[(LABELS, POD_LABELS)],
    ),
    c(
        "skip_deprecated_logs_off",
        &[
            ("ENVOY_SKIP_DEPRECATED_LOGS", "false"),
            ("ISTIO_META_HTTP10", "1"),
            ("ISTIO_META_DNS_CAPTURE", "T"),
        ],
        "{}",
        &[],
    ),
    c(
        "xds_root_ca_and_signer",
        &[
            ("XDS_ROOT_CA", "./var/run/secrets/istio/root-cert.pem"),
            ("ISTIO_META_CERT_SIGNER", "signer-a"),
            ("ISTIO_META_TLS_CLIENT_ROOT_CERT", "/etc/certs/root.pem"),
        ],
        "{}",
        &[],
    ),
    c(
        "no_mesh_id_cluster_id",
        &[("ISTIO_META_MESH_ID", ""), ("ISTIO_META_CLUSTER_ID", "")],
        "{}",
        &[],
    ),
    c(
        "custom_template_yaml",
        &[("ISTIO_BOOTSTRAP", "./custom/bootstrap.yaml")],
        "{}",
        &[(
            "./custom/bootstrap.yaml",
            "node:\n  id: {{ .nodeID }}\n  cluster: {{ .cluster }}\nadmin:\n  address:\n    socket_address: {address: {{ .localhost }}, port_value: {{ .config.ProxyAdminPort }}}\n",
        )],
    ),
    c(
        "holdapp_and_headers",
        &[],
        r#"{"holdApplicationUntilProxyStarts": true, "proxyHeaders": {"server": {"disabled": true}}, "meshId": "mesh-2"}"#,
        &[],
    ),
    // Proxyless gRPC: Istio's `grpc-agent` injection template.
    c(
        "grpc_bootstrap",
        &[
            ("DISABLE_ENVOY", "true"),
            (
                "GRPC_XDS_BOOTSTRAP",
                "./etc/istio/proxy/grpc-bootstrap.json",
            ),
        ],
        "{}",
        &[(LABELS, POD_LABELS)],
    ),
    c(
        "grpc_bootstrap_certs",
        &[
            ("DISABLE_ENVOY", "true"),
            (
                "GRPC_XDS_BOOTSTRAP",
                "./etc/istio/proxy/grpc-bootstrap.json",
            ),
            ("OUTPUT_CERTS", "./var/lib/istio/data"),
        ],
        "{}",
        &[],
    ),
    c(
        "grpc_bootstrap_meta",
        &[
            ("DISABLE_ENVOY", "true"),
            (
                "GRPC_XDS_BOOTSTRAP",
                "./etc/istio/proxy/grpc-bootstrap.json",
            ),
            ("ISTIO_META_GENERATOR", "grpc"),
            ("ISTIO_META_NETWORK", "net-1"),
        ],
        r#"{"discoveryAddress": "istiod.istio-system.svc:15010", "controlPlaneAuthPolicy": "NONE"}"#,
        &[(
            LABELS,
            "app=\"echo\"\ntopology.kubernetes.io/region=\"r1\"\ntopology.kubernetes.io/zone=\"z1\"\n",
        )],
    ),
    c(
        "grpc_bootstrap_ipv6",
        &[
            ("DISABLE_ENVOY", "true"),
            (
                "GRPC_XDS_BOOTSTRAP",
                "./etc/istio/proxy/grpc-bootstrap.json",
            ),
            ("INSTANCE_IP", "fd00::3"),
        ],
        "{}",
        &[],
    ),
];

/// What differs between runs of the *same* agent, normalised in every output before comparing,
/// each with its reason:
/// - the run's working directory (a temp dir) in absolute paths, as `/`: meshagent resolves
///   `./etc/istio/proxy/XDS` and OUTPUT_CERTS files against its working directory for the
///   gRPC bootstrap, which in a pod is `/` (Istio writes `unix:///` + the relative path).
///
/// Nothing else is: ports, paths and IPs are the same in every run (a network namespace per
/// run), and neither agent writes a timestamp or PID into these files.
fn normalise(text: &str, work: &Path) -> String {
    text.replace(&format!("{}/", work.display()), "/")
}

/// Differences that are known and listed in COMPAT.md's "Deliberate differences": (case, the
/// differing paths). Each listed path must still differ (so a fix removes it here and from
/// COMPAT.md), and nothing else may differ. `outcome` is what happened (Envoy started, gRPC
/// bootstrap written, the agent exited); `argv[i]` an argument; `/...` a bootstrap field.
const KNOWN: &[(&str, &[&str])] = &[
    // COMPAT.md "OpenCensus/Stackdriver tracing": Envoy 1.40 has no OpenCensus tracer, so
    // Istio's bootstrap cannot start it; meshagent says so at startup.
    ("tracing_opencensus", &["outcome"]),
    // COMPAT.md "gRPC bootstrap certificate paths": a relative OUTPUT_CERTS is written as
    // absolute paths, so the gRPC application (another working directory) finds the files.
    (
        "grpc_bootstrap_certs",
        &[
            "/certificate_providers/default/config/ca_certificate_file",
            "/certificate_providers/default/config/certificate_file",
            "/certificate_providers/default/config/private_key_file",
        ],
    ),
];

/// What a run produced.
#[derive(Debug)]
enum Outcome {
    /// The agent started Envoy: its argv and the `-c` file (parsed JSON, or its text).
    Envoy { argv: Vec<String>, config: Value },
    /// `DISABLE_ENVOY`: the gRPC bootstrap file, parsed.
    Grpc(Value),
    /// The agent exited before either (with its status).
    Exited(String),
    /// Neither within the deadline.
    Timeout,
}

impl Outcome {
    fn kind(&self) -> &'static str {
        match self {
            Outcome::Envoy { .. } => "envoy started",
            Outcome::Grpc(_) => "gRPC bootstrap written",
            Outcome::Exited(_) => "agent exited",
            Outcome::Timeout => "nothing within the deadline",
        }
    }
}

struct Run {
    outcome: Outcome,
    log: String,
}

/// Shared by every run: the fake Envoy (one path, so `binaryPath` in the node's
/// `PROXY_CONFIG` metadata is the same for both agents), a root certificate, Istio's template.
struct Fixture {
    fake_envoy: PathBuf,
    root_cert: PathBuf,
    template: PathBuf,
    _dir: tempfile::TempDir,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let fake_envoy = dir.path().join("envoy");
    std::fs::write(&fake_envoy, FAKE_ENVOY).unwrap();
    std::fs::set_permissions(
        &fake_envoy,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    // pilot-agent builds its CA client (a TLS config from this file) before starting Envoy;
    // an unparseable file is a startup error (`security/pkg/nodeagent/caclient`).
    let root_cert = dir.path().join("root-cert.pem");
    let ok = Command::new("openssl")
        .args(["req", "-x509", "-newkey", "ec", "-pkeyopt"])
        .args(["ec_paramgen_curve:P-256", "-nodes", "-days", "3650"])
        .args(["-subj", "/O=cluster.local", "-keyout"])
        .arg(dir.path().join("root-key.pem"))
        .arg("-out")
        .arg(&root_cert)
        .output()
        .unwrap();
    assert!(ok.status.success(), "openssl: {ok:?}");
    Fixture {
        fake_envoy,
        root_cert,
        template: istio_bootstrap_template(),
        _dir: dir,
    }
}

/// The deadline for an agent to start Envoy or write the gRPC bootstrap (both take well under
/// a second idle; generous for a loaded machine).
const DEADLINE: Duration = Duration::from_secs(60);

fn run(who: &str, bin: &Path, case: &Case, fx: &Fixture) -> Run {
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().join("work");
    let capture = dir.path().join("capture");
    std::fs::create_dir_all(&capture).unwrap();
    for d in [
        "var/run/secrets/istio",
        "var/lib/istio/envoy",
        "etc/istio/pod",
    ] {
        std::fs::create_dir_all(work.join(d)).unwrap();
    }
    std::fs::copy(
        &fx.root_cert,
        work.join("var/run/secrets/istio/root-cert.pem"),
    )
    .unwrap();
    std::fs::copy(
        &fx.template,
        work.join("var/lib/istio/envoy/envoy_bootstrap_tmpl.json"),
    )
    .unwrap();
    for (path, text) in case.files {
        let p = work.join(path);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        if *text == ROOT_CERT {
            std::fs::copy(&fx.root_cert, p).unwrap();
        } else {
            std::fs::write(p, text).unwrap();
        }
    }
    let mut pc: Map<String, Value> = serde_json::from_str(case.pc).unwrap();
    pc.insert("binaryPath".into(), json!(fx.fake_envoy));
    let mut env: Vec<(&str, String)> = BASE_ENV
        .iter()
        .filter(|(k, _)| !case.env.iter().any(|(ck, _)| ck == k))
        .map(|(k, v)| (*k, (*v).to_owned()))
        .collect();
    env.extend(case.env.iter().map(|(k, v)| (*k, (*v).to_owned())));
    env.push(("PROXY_CONFIG", Value::Object(pc).to_string()));

    let mut cmd = Command::new("unshare");
    cmd.args(["--net", "--", "sh", "-c", case.netns, "sh"])
        .arg(bin)
        .args(case.args)
        .current_dir(&work)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .envs(env.iter().map(|(k, v)| (k, v)));
    let mut proc = Proc::spawn(who, cmd, dir.path());
    let grpc = case
        .env
        .iter()
        .find(|(k, _)| *k == "GRPC_XDS_BOOTSTRAP")
        .filter(|_| case.env.contains(&("DISABLE_ENVOY", "true")))
        .map(|(_, p)| work.join(p));
    let start = Instant::now();
    let outcome = loop {
        if let Some(p) = &grpc {
            // Written in place by Istio (`os.WriteFile`): read until it parses.
            if let Some(v) = std::fs::read_to_string(p)
                .ok()
                .and_then(|t| serde_json::from_str::<Value>(&normalise(&t, &work)).ok())
            {
                break Outcome::Grpc(v);
            }
        } else if let Ok(argv) = std::fs::read_to_string(capture.join("argv")) {
            let text = std::fs::read_to_string(capture.join("config")).unwrap_or_default();
            let text = normalise(&text, &work);
            let config = parse_lenient(&text)
                .map(unwrap_wrappers)
                .unwrap_or(Value::String(text));
            break Outcome::Envoy {
                argv: argv.lines().map(|a| normalise(a, &work)).collect(),
                config,
            };
        }
        if let Some(status) = proc.try_wait() {
            break Outcome::Exited(status.to_string());
        }
        if start.elapsed() > DEADLINE {
            break Outcome::Timeout;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    proc.kill();
    Run {
        outcome,
        log: proc.log_text(),
    }
}

/// JSON as Envoy reads a bootstrap: a comma before `}` or `]` is accepted. (Istio's template
/// leaves one after the status listener's proxy-protocol filter,
/// `ENVOY_STATUS_PORT_ENABLE_PROXY_PROTOCOL`; Envoy 1.40 validates that file.)
fn parse_lenient(text: &str) -> Option<Value> {
    if let Ok(v) = serde_json::from_str(text) {
        return Some(v);
    }
    let mut out = String::with_capacity(text.len());
    let (mut in_str, mut escaped) = (false, false);
    let chars: Vec<char> = text.chars().collect();
    for (i, &ch) in chars.iter().enumerate() {
        if in_str {
            if escaped {
                escaped = false;
            } else if ch == '\\' {
                escaped = true;
            } else if ch == '"' {
                in_str = false;
            }
            out.push(ch);
            continue;
        }
        if ch == '"' {
            in_str = true;
        }
        let next = chars[i + 1..].iter().find(|c| !c.is_whitespace());
        if ch == ',' && matches!(next, Some('}' | ']')) {
            continue;
        }
        out.push(ch);
    }
    serde_json::from_str(&out).ok()
}

/// `{"value": n}` as `n`. Istio writes the metrics and access-log services' TCP keepalive
/// (`upstream_connection_options`) with Go's `encoding/json` over `wrapperspb.UInt32Value`
/// (pkg/bootstrap/option/convert.go `keepaliveConverter`), an object Envoy reads as the plain
/// number that proto-JSON (and meshagent) writes.
fn unwrap_wrappers(v: Value) -> Value {
    match v {
        Value::Object(m) if m.len() == 1 && m.get("value").is_some_and(Value::is_u64) => {
            m["value"].clone()
        }
        Value::Object(m) => Value::Object(
            m.into_iter()
                .map(|(k, v)| (k, unwrap_wrappers(v)))
                .collect(),
        ),
        Value::Array(a) => Value::Array(a.into_iter().map(unwrap_wrappers).collect()),
        v => v,
    }
}

/// The differences between meshagent's run (`got`) and pilot-agent's (`want`): one line each,
/// starting with its path.
fn compare(pool: &prost_reflect::DescriptorPool, got: &Outcome, want: &Outcome) -> Vec<String> {
    let mut out = vec![];
    match (got, want) {
        (
            Outcome::Envoy {
                argv: ga,
                config: gc,
            },
            Outcome::Envoy {
                argv: wa,
                config: wc,
            },
        ) => {
            for i in 0..ga.len().max(wa.len()) {
                let (g, w) = (ga.get(i), wa.get(i));
                if g != w {
                    out.push(format!("argv[{i}]: got {g:?}, expected {w:?}"));
                }
            }
            // As Bootstrap protos when both sides are one; else (a template's YAML, or a
            // bootstrap Envoy would reject) as JSON, with the failure named under `proto`.
            match (as_bootstrap_proto(pool, gc), as_bootstrap_proto(pool, wc)) {
                (Ok(g), Ok(w)) => diff("", &g, &w, &mut out),
                (Err(_), Err(_)) => diff("", gc, wc, &mut out),
                (g, w) => {
                    out.push(format!(
                        "proto: meshagent's is {}, pilot-agent's is {}",
                        g.err().unwrap_or_else(|| "a Bootstrap".into()),
                        w.err().unwrap_or_else(|| "a Bootstrap".into())
                    ));
                    diff("", gc, wc, &mut out);
                }
            }
        }
        (Outcome::Grpc(g), Outcome::Grpc(w)) => diff("", g, w, &mut out),
        (g, w) if g.kind() == w.kind() && matches!(g, Outcome::Exited(_)) => {}
        (g, w) => out.push(format!("outcome: got {}, expected {}", g.kind(), w.kind())),
    }
    out
}

/// An outcome for the failure report: whole bootstraps are left out (the diff names fields).
fn brief(o: &Outcome) -> String {
    match o {
        Outcome::Envoy { argv, .. } => format!("{} {argv:?}", o.kind()),
        Outcome::Exited(s) => format!("{} ({s})", o.kind()),
        _ => o.kind().to_owned(),
    }
}

/// The path a difference line starts with.
fn path_of(line: &str) -> &str {
    line.split_once(": ").map_or(line, |(p, _)| p)
}

#[test]
fn bootstraps_match_pilot_agent() {
    let pa = pilot_agent();
    let ma = PathBuf::from(env!("CARGO_BIN_EXE_meshagent"));
    let fx = fixture();
    let pool = envoy_descriptors();
    assert!(CASES.len() >= 40, "only {} cases", CASES.len());
    for (name, _) in KNOWN {
        assert!(
            CASES.iter().any(|c| c.name == *name),
            "KNOWN names no case {name}"
        );
    }
    // COMPAT_BOOTSTRAP_CASES=a,b runs only those cases (when working on a difference).
    let only_var = std::env::var("COMPAT_BOOTSTRAP_CASES").unwrap_or_default();
    let only: Vec<&str> = only_var.split(',').filter(|s| !s.is_empty()).collect();
    let next = AtomicUsize::new(0);
    let report = Mutex::new(Vec::new());
    let t0 = Instant::now();
    // Each run is in a network namespace of its own: cases run side by side.
    std::thread::scope(|s| {
        for _ in 0..3 {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    let Some(case) = CASES.get(i) else { break };
                    if !only.is_empty() && !only.contains(&case.name) {
                        continue;
                    }
                    let (want, got) = std::thread::scope(|s2| {
                        let want = s2.spawn(|| run("pilot-agent", &pa, case, &fx));
                        let got = run("meshagent", &ma, case, &fx);
                        (want.join().unwrap(), got)
                    });
                    let mut problems = vec![];
                    // Every case is one Istio starts with: anything else is a broken harness.
                    if !matches!(want.outcome, Outcome::Envoy { .. } | Outcome::Grpc(_)) {
                        problems.push(format!(
                            "pilot-agent did not start: {:?}",
                            want.outcome
                        ));
                    }
                    let diffs = compare(&pool, &got.outcome, &want.outcome);
                    let differing: BTreeSet<&str> = diffs.iter().map(|l| path_of(l)).collect();
                    let known: &[&str] = KNOWN
                        .iter()
                        .find(|(n, _)| *n == case.name)
                        .map_or(&[], |(_, p)| p);
                    let unlisted: Vec<&String> = diffs
                        .iter()
                        .filter(|l| !known.contains(&path_of(l)))
                        .collect();
                    let gone: Vec<&&str> =
                        known.iter().filter(|p| !differing.contains(**p)).collect();
                    if !unlisted.is_empty() {
                        problems.push(format!(
                            "differs (meshagent = got, pilot-agent = expected):\n  {}",
                            unlisted
                                .iter()
                                .map(|s| s.as_str())
                                .collect::<Vec<_>>()
                                .join("\n  ")
                        ));
                    }
                    if !gone.is_empty() {
                        problems.push(format!(
                            "listed as known differences but now equal (remove them from KNOWN and COMPAT.md): {gone:?}"
                        ));
                    }
                    if !problems.is_empty() {
                        report.lock().unwrap().push(format!(
                            "case {} (args {:?}, env {:?}, ProxyConfig {}):\n{}\n--- pilot-agent: {}\n--- meshagent: {}\n--- pilot-agent log\n{}\n--- meshagent log\n{}",
                            case.name,
                            case.args,
                            case.env,
                            case.pc,
                            problems.join("\n"),
                            brief(&want.outcome),
                            brief(&got.outcome),
                            want.log,
                            got.log
                        ));
                    }
                }
            });
        }
    });
    let report = report.into_inner().unwrap();
    eprintln!("{} cases in {:?}", CASES.len(), t0.elapsed());
    assert!(
        report.is_empty(),
        "{} of {} cases:\n{}",
        report.len(),
        CASES.len(),
        report.join("\n\n")
    );
}
