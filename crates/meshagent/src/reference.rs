//! `meshagent config-reference`: the Markdown reference of every environment variable, flag
//! and annotation the agent reads (`docs/configuration-reference.md`).
//!
//! Generated from the code that reads them, so it cannot drift: the variables, their types
//! and defaults come from the typed reads themselves ([`crate::config::env_catalog`]), the
//! flags from the command line's definition (clap, and `istio-iptables`' flag table), the
//! annotations from their constants. What each one does is the one line per name below; a
//! variable read without a line here, or a line for a variable no longer read, fails the
//! generation (and so the test that compares the file with it).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use clap::CommandFactory;

use crate::config::{
    ANNOTATION_DISCOVERY_ADDRESS, ANNOTATION_PROXY_CONFIG, ANNOTATION_STATUS_PORT, EnvSource,
};

/// Where meshagent is the same as Istio's agent (same name, same behaviour).
const SAME: &str = "same";
/// A variable Istio's agent does not read.
const OWN: &str = "meshagent only";

/// One variable: name (a family as `PREFIX*`), what it does, and how it compares with
/// Istio's agent ([`SAME`], [`OWN`], or the difference).
type Var = (&'static str, &'static str, &'static str);

/// The variables `proxy` reads, by concern: (title, Istio's source, variables).
const SECTIONS: &[(&str, &str, &[Var])] = &[
    (
        "Pod",
        "pilot/cmd/pilot-agent/options/options.go",
        &[
            (
                "POD_NAME",
                "Pod name: node ID and node metadata `NAME`.",
                SAME,
            ),
            (
                "POD_NAMESPACE",
                "Pod namespace: node ID, DNS domain, CSR SAN.",
                SAME,
            ),
            (
                "INSTANCE_IP",
                "Pod IP, put first among the instance IPs.",
                SAME,
            ),
            ("SERVICE_ACCOUNT", "Service account name.", SAME),
            (
                "HOST_IP",
                "Substituted for `$(HOST_IP)` in tracer addresses and bootstrap overrides.",
                SAME,
            ),
            (
                "ISTIO_CPU_LIMIT",
                "Envoy concurrency when ProxyConfig leaves it unset.",
                SAME,
            ),
            (
                "KUBERNETES_SERVICE_HOST",
                "When set (running under Kubernetes), exported certificates are world-readable (0644).",
                SAME,
            ),
            (
                "PROXY_CONFIG",
                "ProxyConfig as YAML or JSON, applied over the mesh config's `defaultConfig` and under the `proxy.istio.io/config` annotation.",
                SAME,
            ),
        ],
    ),
    (
        "Identity and CA",
        "pilot/cmd/pilot-agent/options/security.go",
        &[
            (
                "CA_ADDR",
                "CA gRPC endpoint; when unset, the effective `discoveryAddress`.",
                SAME,
            ),
            (
                "CA_PROVIDER",
                "CA kind; `GoogleCA` whenever `CA_ADDR` contains `googleapis.com`.",
                SAME,
            ),
            (
                "CA_ROOT_CA",
                "Root for the CA's TLS; `SYSTEM` means the OS roots.",
                SAME,
            ),
            (
                "CA_HEADER_*",
                "Extra gRPC metadata `NAME: value` on CSR calls (values redacted in dumps and logs).",
                SAME,
            ),
            (
                "PILOT_CERT_PROVIDER",
                "Where the istiod root comes from: `istiod`, `kubernetes`, `k8s.io/<signer>`, `custom`, `none`.",
                "any other value takes the istiod path in both; meshagent also warns, listing the values",
            ),
            ("TRUST_DOMAIN", "SPIFFE trust domain.", SAME),
            ("SECRET_TTL", "Requested certificate lifetime.", SAME),
            (
                "SECRET_GRACE_PERIOD_RATIO",
                "Rotate when this fraction of the certificate's lifetime remains.",
                SAME,
            ),
            (
                "SECRET_GRACE_PERIOD_RATIO_JITTER",
                "Random spread added to the grace period ratio.",
                SAME,
            ),
            (
                "WORKLOAD_RSA_KEY_SIZE",
                "RSA key size of workload keys.",
                "only 2048, 3072 and 4096 start; Istio generates other sizes (and below 2048 every CSR fails)",
            ),
            (
                "ECC_SIGNATURE_ALGORITHM",
                "`ECDSA` selects EC keys instead of RSA.",
                SAME,
            ),
            ("ECC_CURVE", "`P384`; anything else means P-256.", SAME),
            ("PKCS8_KEY", "Write keys as PKCS#8.", SAME),
            (
                "OUTPUT_CERTS",
                "Directory the key, certificate chain and root are exported to.",
                "written as one set (`..<ts>` generation, one `..data` rename), retried with backoff on failure, directory 0700",
            ),
            (
                "PROV_CERT",
                "Directory with client certificates for the CA and xDS connections (VMs).",
                SAME,
            ),
            (
                "FILE_MOUNTED_CERTS",
                "Use mounted certificate files; never call a CA.",
                SAME,
            ),
            (
                "JWT_POLICY",
                "`third-party-jwt` or `first-party-jwt` use the projected token file; anything else, existing certificates.",
                SAME,
            ),
            (
                "CREDENTIAL_FETCHER_TYPE",
                "How the CA credential is fetched.",
                "only `JWT` (the token file); another value is a start error",
            ),
            (
                "CREDENTIAL_IDENTITY_PROVIDER",
                "Identity provider of the credential fetcher.",
                SAME,
            ),
            (
                "ISTIO_META_CLUSTER_ID",
                "`ClusterID` metadata on CA and xDS calls.",
                SAME,
            ),
            (
                "ISTIO_META_CERT_SIGNER",
                "`CertSigner` in CSR metadata.",
                SAME,
            ),
            ("ISTIOD_SAN", "TLS server name override for istiod.", SAME),
            (
                "WORKLOAD_IDENTITY_SOCKET_FILE",
                "File name of the SDS socket under `./var/run/secrets/workload-spiffe-uds/`.",
                "a name with `/` is a start error",
            ),
            (
                "TOKEN_AUDIENCES",
                "Audiences of the token sent to the CA.",
                SAME,
            ),
            ("XDS_AUTH_PROVIDER", "Stored; no agent logic uses it.", SAME),
            (
                "FILE_DEBOUNCE_DURATION",
                "Initial backoff when re-reading certificate files.",
                SAME,
            ),
            (
                "PILOT_ENABLE_CA_CRL",
                "Attach the CA's CRL file to the roots when present.",
                SAME,
            ),
        ],
    ),
    (
        "Platform",
        "pkg/bootstrap/platform",
        &[
            (
                "GCP_METADATA",
                "GCP project and cluster metadata, `|`-separated.",
                SAME,
            ),
            (
                "GCP_QUOTA_PROJECT",
                "GCP quota project for node metadata.",
                SAME,
            ),
            ("GCP_ZONE", "GCP zone for node metadata.", SAME),
            (
                "CLOUD_PLATFORM",
                "`aws`, `gcp`, `azure` or `none`; unset (or another value, with a warning) means discover it from the metadata servers.",
                SAME,
            ),
            (
                "GCE_METADATA_HOST",
                "The GCE metadata server `host[:port]`; when set the agent takes it that it runs on GCE.",
                SAME,
            ),
            (
                "MESHAGENT_TEST_METADATA_ADDR",
                "Tests only: `host:port` used instead of the link-local metadata addresses; also turns off the `metadata.google.internal` DNS probe.",
                OWN,
            ),
            (
                "MESHAGENT_TEST_DMI_DIR",
                "Tests only: directory read instead of `/sys/class/dmi/id`.",
                OWN,
            ),
        ],
    ),
    (
        "xDS",
        "pkg/istio-agent/xds_proxy.go",
        &[
            (
                "XDS_ROOT_CA",
                "Root for istiod's TLS; `SYSTEM` means the OS roots.",
                SAME,
            ),
            (
                "XDS_HEADER_*",
                "Extra gRPC metadata on upstream ADS streams (values redacted in dumps and logs).",
                SAME,
            ),
            (
                "PROXY_CONFIG_XDS_AGENT",
                "Subscribe to ProxyConfig (PCDS).",
                SAME,
            ),
            (
                "ISTIO_DELTA_XDS",
                "The bootstrap's ADS uses `DELTA_GRPC`.",
                SAME,
            ),
            (
                "GRPC_KEEPALIVE_INTERVAL",
                "Keepalive interval of the istiod connection.",
                SAME,
            ),
            (
                "GRPC_KEEPALIVE_TIMEOUT",
                "Keepalive timeout of the istiod connection.",
                SAME,
            ),
            (
                "ISTIO_GPRC_MAXSTREAMS",
                "(sic) Max concurrent streams from Envoy.",
                SAME,
            ),
            (
                "ISTIO_GPRC_MAXRECVMSGSIZE",
                "(sic) Max message size from Envoy, bytes.",
                SAME,
            ),
            (
                "COMPLIANCE_POLICY",
                "`fips-140-2` / `fips-140-3` / `pqc` restrict TLS versions, ciphers and curves (Envoy's and the agent's own).",
                SAME,
            ),
        ],
    ),
    (
        "Bootstrap",
        "pkg/bootstrap/config.go",
        &[
            ("ISTIO_META_*", "Node metadata `NAME` = value.", SAME),
            (
                "ISTIO_METAJSON_*",
                "A JSON object whose keys are merged at the top of node metadata; `ISTIO_METAJSON_LABELS` also becomes `LABELS` and `STATIC_LABELS`.",
                "a value that is not a JSON object is a start error",
            ),
            ("ISTIO_BOOTSTRAP", "Bootstrap template path override.", SAME),
            (
                "ISTIO_BOOTSTRAP_OVERRIDE",
                "File passed to Envoy as `--config-yaml`.",
                SAME,
            ),
            (
                "ISTIO_META_ENABLE_SELF_DISCOVERY",
                "Add a `local_cluster` to the bootstrap.",
                SAME,
            ),
            (
                "PEER_METADATA_DISCOVERY",
                "Peer metadata discovery; unset means the same as `ENABLE_HBONE`.",
                SAME,
            ),
            ("ENVOY_STATUS_PORT", "Envoy's health listener.", SAME),
            (
                "ENVOY_PROMETHEUS_PORT",
                "Envoy's Prometheus listener.",
                SAME,
            ),
            (
                "ENVOY_SECURE_METRICS_PORT",
                "mTLS listener for Envoy's stats (0 = off).",
                SAME,
            ),
            (
                "ENVOY_SECURE_MERGED_METRICS_PORT",
                "mTLS listener for the merged metrics (0 = off).",
                SAME,
            ),
            (
                "ENVOY_STATUS_PORT_ENABLE_PROXY_PROTOCOL",
                "PROXY protocol on Envoy's health listener.",
                SAME,
            ),
            (
                "ISTIO_DUAL_STACK",
                "Dual-stack listeners and clusters.",
                SAME,
            ),
            (
                "HTTP_STRIP_FRAGMENT_FROM_PATH_UNSAFE_IF_DISABLED",
                "Envoy strips URL fragments from request paths.",
                SAME,
            ),
            (
                "ENVOY_SKIP_DEPRECATED_LOGS",
                "Envoy skips deprecated-feature logs.",
                SAME,
            ),
            (
                "ISTIO_ENVOY_ENABLE_CORE_DUMP",
                "Let Envoy write core dumps.",
                SAME,
            ),
            (
                "ISTIO_META_ISTIO_PROXY_SHA",
                "Envoy build SHA, set in the image.",
                SAME,
            ),
        ],
    ),
    (
        "Lifecycle",
        "pkg/envoy/agent.go",
        &[
            (
                "MESHAGENT_DRAIN_START_DELAY",
                "On SIGTERM, how long readiness answers 503 before Envoy's listeners are drained (docs/drain.md).",
                OWN,
            ),
            (
                "METRIC_ROTATION_INTERVAL",
                "Removed from Istio; read only to warn once that it has no effect.",
                "Istio ignores it silently; meshagent warns once",
            ),
            (
                "METRIC_GRACEFUL_DELETION_INTERVAL",
                "Removed from Istio; read only to warn once that it has no effect.",
                "Istio ignores it silently; meshagent warns once",
            ),
            (
                "MINIMUM_DRAIN_DURATION",
                "Wait before polling Envoy's active connections during a drain.",
                SAME,
            ),
            (
                "EXIT_ON_ZERO_ACTIVE_CONNECTIONS",
                "End the drain when Envoy has no active connections.",
                SAME,
            ),
            (
                "DISABLE_ENVOY",
                "Proxyless mode: no Envoy (gRPC applications use the agent's xDS and certificates).",
                SAME,
            ),
        ],
    ),
    (
        "Status port, probes and metrics",
        "pilot/cmd/pilot-agent/options/statusserver.go",
        &[
            (
                "ISTIO_KUBE_APP_PROBERS",
                "JSON map of `/app-health/...` paths to the app's HTTP, TCP or gRPC probes; invalid JSON is a start error.",
                SAME,
            ),
            (
                "ISTIO_PROMETHEUS_ANNOTATIONS",
                "JSON of the app's `prometheus.io/*` annotations: the metrics target merged into `/stats/prometheus`.",
                SAME,
            ),
            (
                "ISTIO_ENABLE_HTTP2_PROBING",
                "App probes over HTTPS negotiate HTTP/2 (ALPN), as kubelet does.",
                SAME,
            ),
            (
                "REWRITE_PROBE_LEGACY_LOCALHOST_DESTINATION",
                "Send app probes to loopback instead of the pod IP (`INSTANCE_IP`, the default, as Kubernetes does).",
                SAME,
            ),
            (
                "ENABLE_PROBE_KEEPALIVE_CONNECTIONS",
                "Keep HTTP probe connections to the app open.",
                SAME,
            ),
            (
                "PILOT_AGENT_MERGE_ENVOY_STATS",
                "Merge Envoy's stats into `/stats/prometheus`.",
                SAME,
            ),
            (
                "METRICS_LOCALHOST_ACCESS_ONLY",
                "Serve metrics to loopback peers only.",
                SAME,
            ),
            (
                "MESHAGENT_PROFILING",
                "With `--profiling` (default on), serve CPU profiles on `/debug/pprof/profile` (loopback; docs/debugging.md).",
                "Istio serves Go's pprof with `--profiling` alone; meshagent's profiler needs this too",
            ),
        ],
    ),
    (
        "DNS proxy",
        "pkg/dns/client/dns.go",
        &[
            (
                "ISTIO_META_DNS_CAPTURE",
                "Start the DNS proxy (sidecars).",
                "a value that is not a bool is a start error only, without Istio's \"defaulting to false\" warning before it",
            ),
            (
                "ISTIO_META_ENABLE_DNS_SERVER",
                "Start the DNS proxy for any proxy type.",
                SAME,
            ),
            (
                "DNS_PROXY_ADDR",
                "The DNS proxy's listen address (`localhost:15053` when unset or empty).",
                "a non-loopback address is a start error unless `MESHAGENT_DNS_ALLOW_NON_LOOPBACK=true`",
            ),
            (
                "DNS_FORWARD_PARALLEL",
                "Query all upstream servers at once.",
                SAME,
            ),
            ("DNS_FORWARD_TIMEOUT", "Timeout of a forwarded query.", SAME),
            (
                "ISTIO_META_DNS_AUTO_ALLOCATE",
                "istiod-side address allocation; read for node metadata.",
                SAME,
            ),
            (
                "MESHAGENT_DNS_CACHE_SIZE",
                "Entries in the cache of forwarded answers (0 turns it off); Istio has no cache (Istio #58806).",
                OWN,
            ),
            (
                "MESHAGENT_DNS_CACHE_BYTES",
                "Byte budget of that cache (0 turns it off); answers over 16 KiB are not cached.",
                OWN,
            ),
            (
                "MESHAGENT_DNS_ALLOW_NON_LOOPBACK",
                "Let `DNS_PROXY_ADDR` be an address that is not loopback (the proxy then answers, and amplifies, for anyone).",
                OWN,
            ),
        ],
    ),
    (
        "Wasm",
        "pkg/wasm/options.go",
        &[
            (
                "WASM_INSECURE_REGISTRIES",
                "Registries allowed over plain HTTP or unverified TLS; `*` = all.",
                SAME,
            ),
            (
                "WASM_MODULE_EXPIRY",
                "Unused cached modules are removed after this.",
                SAME,
            ),
            (
                "WASM_PURGE_INTERVAL",
                "How often the module cache is purged.",
                SAME,
            ),
            (
                "WASM_HTTP_REQUEST_TIMEOUT",
                "Timeout of one module download.",
                SAME,
            ),
            (
                "WASM_HTTP_REQUEST_MAX_RETRIES",
                "Retries of a module download.",
                SAME,
            ),
            (
                "ISTIO_WASM_MAX_BINARY_SIZE_BYTES",
                "Largest module accepted, bytes.",
                SAME,
            ),
            (
                "BLOCKED_CIDRS_IN_WASM_FETCH",
                "Extra CIDRs module downloads may not connect to.",
                "an entry that is not a CIDR is a start error",
            ),
            (
                "ISTIO_AGENT_ENABLE_WASM_REMOTE_LOAD_CONVERSION",
                "Download remote Wasm named in ECDS and hand Envoy a local file.",
                SAME,
            ),
            (
                "DOCKER_CONFIG",
                "Directory of the docker `config.json` used for OCI pulls without a pull secret.",
                SAME,
            ),
            (
                "HOME",
                "`$HOME/.docker/config.json` is used when `DOCKER_CONFIG` is unset.",
                SAME,
            ),
        ],
    ),
    (
        "Proxyless gRPC",
        "pkg/istio-agent/grpcxds/grpc_bootstrap.go",
        &[
            (
                "GRPC_XDS_BOOTSTRAP",
                "Where the gRPC xDS bootstrap is written; set but empty: none is written and readiness does not wait for it.",
                SAME,
            ),
            (
                "ISTIO_META_GENERATOR",
                "`grpc` selects the grpc-agent template.",
                SAME,
            ),
        ],
    ),
];

/// Variables read outside `Config`, before it exists or by the runtime: (name, type,
/// default, what it does, compared with Istio's agent).
const OUTSIDE: &[(&str, &str, &str, &str, &str)] = &[
    (
        "MESHAGENT_RELEASE_CODE_PAGES",
        "`false`/`0` or anything",
        "on",
        "`false` or `0` keep the page-table entries of the binary's read-only segments (`code_pages.rs`; for measuring, or kernels where re-faulting is expensive).",
        OWN,
    ),
    (
        "MALLOC_ARENA_MAX",
        "integer (glibc)",
        "1 (set by the agent)",
        "When set, the agent leaves glibc's arena count to it (`malloc.rs`).",
        OWN,
    ),
    (
        "MALLOC_MMAP_THRESHOLD_",
        "integer (glibc)",
        "128 KiB (set by the agent)",
        "When set, the agent leaves glibc's mmap threshold to it (`malloc.rs`).",
        OWN,
    ),
    (
        "GLIBC_TUNABLES",
        "glibc tunables",
        "unset",
        "`glibc.malloc.arena_max` / `glibc.malloc.mmap_threshold` there win over the agent's settings (`malloc.rs`).",
        OWN,
    ),
    (
        "PATH",
        "directory list",
        "the process's",
        "Where `istio-iptables` finds `iptables`, `ip6tables` and `nft` (`iptables/apply.rs`).",
        SAME,
    ),
    (
        "MESHAGENT_TEST_PANIC",
        "task name",
        "unset",
        "Debug builds only: the named long-lived task panics once, to test task supervision (`tasks.rs`).",
        OWN,
    ),
];

/// What each `istio-iptables` flag does (Istio `tools/istio-iptables/pkg/cmd/root.go`).
const IPTABLES_FLAGS: &[(&str, &str)] = &[
    (
        "envoy-port",
        "Envoy's outbound capture port (default 15001).",
    ),
    (
        "inbound-capture-port",
        "Envoy's inbound capture port (default 15006).",
    ),
    (
        "inbound-tunnel-port",
        "Envoy's inbound tunnel port (default 15008).",
    ),
    (
        "proxy-uid",
        "UIDs whose traffic is not captured (default: `ENVOY_USER`'s, else 1337).",
    ),
    (
        "proxy-gid",
        "GIDs whose traffic is not captured (default: the UIDs).",
    ),
    (
        "istio-inbound-interception-mode",
        "`REDIRECT` or `TPROXY` for inbound traffic.",
    ),
    (
        "istio-inbound-ports",
        "Inbound ports to capture; `*` = all, empty = none.",
    ),
    (
        "istio-local-exclude-ports",
        "Inbound ports not captured when `*` is given.",
    ),
    (
        "istio-exclude-interfaces",
        "Interfaces whose traffic is not captured.",
    ),
    (
        "istio-service-cidr",
        "Outbound CIDRs to capture; `*` = all.",
    ),
    ("istio-service-exclude-cidr", "Outbound CIDRs not captured."),
    (
        "istio-outbound-ports",
        "Outbound ports captured whatever the CIDR.",
    ),
    (
        "istio-local-outbound-ports-exclude",
        "Outbound ports not captured.",
    ),
    (
        "kube-virt-interfaces",
        "KubeVirt interfaces whose inbound traffic is captured as outbound.",
    ),
    (
        "istio-inbound-tproxy-mark",
        "Packet mark for TPROXY (default 1337).",
    ),
    (
        "istio-inbound-tproxy-route-table",
        "Routing table for TPROXY (default 133).",
    ),
    ("dry-run", "Print the rules instead of applying them."),
    (
        "iptables-probe-port",
        "Port of the rule-validation probe (default 15002).",
    ),
    (
        "probe-timeout",
        "Timeout of the rule-validation probe (default 5s).",
    ),
    ("skip-rule-apply", "Do not apply the rules."),
    (
        "run-validation",
        "Check the rules capture traffic after applying them.",
    ),
    ("redirect-dns", "Capture DNS to the agent's DNS proxy."),
    (
        "drop-invalid",
        "Drop packets in the INVALID conntrack state.",
    ),
    ("dual-stack", "Capture IPv6 as well."),
    (
        "capture-all-dns",
        "Capture all DNS, not only to the resolv.conf servers.",
    ),
    (
        "network-namespace",
        "Network namespace to apply the rules in (CNI).",
    ),
    ("cni-mode", "Running under the Istio CNI plugin."),
    (
        "reconcile",
        "Replace rules left from an earlier run that differ.",
    ),
    ("cleanup-only", "Remove Istio's rules and add none."),
    ("force-apply", "Apply even if Istio's chains exist."),
    (
        "native-nftables",
        "Write nftables rules with `nft` instead of iptables.",
    ),
    (
        "force-iptables-binary",
        "Use this iptables binary (legacy or nft) instead of detecting.",
    ),
    (
        "log_output_level",
        "Root logging flag, as on every pilot-agent command.",
    ),
    (
        "log_target",
        "Root logging flag, as on every pilot-agent command.",
    ),
    (
        "log_caller",
        "Root logging flag, as on every pilot-agent command.",
    ),
    (
        "log_stacktrace_level",
        "Root logging flag, as on every pilot-agent command.",
    ),
    (
        "log_as_json",
        "Root logging flag, as on every pilot-agent command.",
    ),
    (
        "vklog",
        "klog verbosity (`Level`); accepted as pilot-agent does and unused.",
    ),
];

/// What each variable `istio-iptables` reads without a flag does.
const IPTABLES_ENV: &[(&str, &str)] = &[
    (
        "DRY_RUN_FILE_PATH",
        "With `--dry-run`, also write every command and restore input, in Istio's order, to this file.",
    ),
    (
        "ENVOY_USER",
        "User whose UID is the default `--proxy-uid` (`istio-proxy`; 1337 when it does not exist).",
    ),
    (
        "ISTIO_OUTBOUND_IPV4_LOOPBACK_CIDR",
        "Loopback CIDR whose outbound traffic is not captured (default 127.0.0.1/32).",
    ),
    (
        "ISTIO_OUTBOUND_OWNER_GROUPS",
        "Groups whose outbound traffic is captured (`*` or empty = all; at most 64).",
    ),
    (
        "ISTIO_OUTBOUND_OWNER_GROUPS_EXCLUDE",
        "Groups whose outbound traffic is not captured (not with the include list).",
    ),
];

/// Flags (and subcommands) Istio's agent does not have: (command, flag or "" for the
/// command itself, the difference).
const FLAG_DIFFERENCES: &[(&str, &str, &str)] =
    &[("proxy", "dump-config", OWN), ("config-reference", "", OWN)];

/// The annotations the agent reads from the downward API files
/// (`./etc/istio/pod/annotations`): (name, what, where it is read).
const ANNOTATIONS: &[(&str, &str, &str)] = &[
    (
        ANNOTATION_PROXY_CONFIG,
        "ProxyConfig overlay (YAML), applied over `PROXY_CONFIG` and the mesh config.",
        "`config.rs`",
    ),
    (
        ANNOTATION_DISCOVERY_ADDRESS,
        "Overrides ProxyConfig `discoveryAddress`.",
        "`config.rs`",
    ),
    (
        ANNOTATION_STATUS_PORT,
        "Overrides ProxyConfig `statusPort`; not a port number is a start error.",
        "`config.rs`",
    ),
    (
        crate::bootstrap::stats::ANNOTATION_INCLUSION_PREFIXES,
        "Envoy stats inclusion prefixes.",
        "`bootstrap/stats.rs`",
    ),
    (
        crate::bootstrap::stats::ANNOTATION_INCLUSION_SUFFIXES,
        "Envoy stats inclusion suffixes.",
        "`bootstrap/stats.rs`",
    ),
    (
        crate::bootstrap::stats::ANNOTATION_INCLUSION_REGEXPS,
        "Envoy stats inclusion regexps.",
        "`bootstrap/stats.rs`",
    ),
    (
        crate::bootstrap::stats::ANNOTATION_EXTRA_STAT_TAGS,
        "Extra Envoy stat tags.",
        "`bootstrap/stats.rs`",
    ),
    (
        crate::bootstrap::stats::ANNOTATION_HISTOGRAM_BUCKETS,
        "Envoy histogram buckets per prefix (JSON).",
        "`bootstrap/stats.rs`",
    ),
    (
        crate::bootstrap::stats::ANNOTATION_FLUSH_INTERVAL,
        "Envoy stats flush interval.",
        "`bootstrap/stats.rs`",
    ),
    (
        crate::bootstrap::stats::ANNOTATION_EVICTION_INTERVAL,
        "Envoy stats eviction interval (a multiple of the flush interval).",
        "`bootstrap/stats.rs`",
    ),
    (
        crate::bootstrap::node::EXCLUDE_INTERFACES_ANNOTATION,
        "Interfaces left out of the instance IPs in node metadata.",
        "`bootstrap/node.rs`",
    ),
];

/// The reference as Markdown, or what is missing from the tables above.
pub fn markdown() -> Result<String, String> {
    let catalog = crate::config::env_catalog();
    check_vars(&catalog)?;
    let mut out = String::new();
    out.push_str(HEADER);

    out.push_str("\n## Environment variables of `proxy`\n\n");
    out.push_str(
        "Type and default are those of the code that reads the variable \
         (`crates/meshagent/src/config/`). A bool, number or duration that does not parse \
         is a warning and the default, as in Istio (`pkg/env/var.go`); a value that parses \
         but cannot work (out of range, a bad address) is a start error naming the variable. \
         \"vs Istio\" is `same` when the name and behaviour are Istio's.\n",
    );
    for (title, source, vars) in SECTIONS {
        let _ = write!(out, "\n### {title}\n\nIstio: `{source}`.\n\n");
        out.push_str(
            "| variable | type | default | what it does | vs Istio |\n|---|---|---|---|---|\n",
        );
        for (name, what, istio) in *vars {
            let (kind, default) = &catalog[*name];
            let shown = name.replace('*', "<NAME>");
            let _ = writeln!(out, "| `{shown}` | {kind} | {default} | {what} | {istio} |");
        }
    }

    out.push_str("\n### Read outside the typed configuration\n\n");
    out.push_str(
        "Read directly where they are needed, before the configuration exists or by the \
         runtime.\n\n| variable | type | default | what it does | vs Istio |\n|---|---|---|---|---|\n",
    );
    for (name, kind, default, what, istio) in OUTSIDE {
        let _ = writeln!(out, "| `{name}` | {kind} | {default} | {what} | {istio} |");
    }

    out.push_str("\n## Flags\n\n");
    out.push_str(
        "The same flags as `pilot-agent` (Istio `pilot/cmd/pilot-agent/app/cmd.go`); unknown \
         flags are dropped with a warning, as cobra's `FParseErrWhitelist` does. The root \
         logging flags are accepted by every command.\n",
    );
    let cli = crate::cli::Cli::command();
    out.push_str("\n### Root (every command)\n\n");
    flag_table(
        &mut out,
        "",
        cli.get_arguments().filter(|a| a.is_global_set()),
    );
    for sub in cli.get_subcommands() {
        let name = sub.get_name();
        let about = sub.get_about().map(|a| a.to_string()).unwrap_or_default();
        let _ = write!(out, "\n### `{name}`\n\n{about}");
        if let Some((_, _, d)) = FLAG_DIFFERENCES
            .iter()
            .find(|(c, f, _)| *c == name && f.is_empty())
        {
            let _ = write!(out, " ({d})");
        }
        out.push_str(".\n\n");
        let args: Vec<_> = sub.get_arguments().filter(|a| !a.is_global_set()).collect();
        if args.is_empty() {
            out.push_str("No flags.\n");
        } else {
            flag_table(&mut out, name, args.into_iter());
        }
    }

    out.push_str("\n### `istio-iptables`\n\n");
    out.push_str(
        "Dispatched before the agent's command line, with Istio's pflag semantics: each \
         flag is also read from the environment variables listed (the last one set wins; a \
         flag wins over them). Istio: `tools/istio-iptables/pkg/cmd/root.go`; same flags.\n\n\
         | flag | type | environment | what it does |\n|---|---|---|---|\n",
    );
    for f in crate::iptables::config::flags() {
        let what = IPTABLES_FLAGS
            .iter()
            .find(|(n, _)| *n == f.long)
            .map(|(_, w)| *w)
            .ok_or_else(|| {
                format!(
                    "istio-iptables flag --{} has no line in reference.rs",
                    f.long
                )
            })?;
        let short = f.short.map(|c| format!(", `-{c}`")).unwrap_or_default();
        let env = match f.env.as_slice() {
            [] => "—".to_owned(),
            env => env
                .iter()
                .map(|e| format!("`{e}`"))
                .collect::<Vec<_>>()
                .join(", "),
        };
        let kind = if f.bool { "bool" } else { "string" };
        let _ = writeln!(out, "| `--{}`{short} | {kind} | {env} | {what} |", f.long);
    }
    out.push_str(
        "\nRead from the environment only (Istio `tools/istio-iptables/pkg/constants`):\n\n\
         | variable | what it does |\n|---|---|\n",
    );
    for name in iptables_env_only() {
        let what = IPTABLES_ENV
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, w)| *w)
            .ok_or_else(|| {
                format!("istio-iptables reads {name}, which has no line in reference.rs")
            })?;
        let _ = writeln!(out, "| `{name}` | {what} |");
    }

    out.push_str("\n## Pod annotations\n\n");
    out.push_str(
        "Read from the downward API file `./etc/istio/pod/annotations` (and labels from \
         `./etc/istio/pod/labels`), as Istio's agent reads them.\n\n\
         | annotation | what it does | read in |\n|---|---|---|\n",
    );
    for (name, what, file) in ANNOTATIONS {
        let _ = writeln!(out, "| `{name}` | {what} | {file} |");
    }
    Ok(out)
}

const HEADER: &str = "# Configuration reference\n\n\
Every environment variable, flag and annotation meshagent reads, with its type, default, and \
how it compares with Istio's agent (`pilot-agent`). Generated by `meshagent config-reference` \
from the code that reads them; do not edit by hand (a test fails when this file is stale: \
`cargo run -p meshagent -- config-reference > docs/configuration-reference.md`). ProxyConfig \
fields (mesh config `defaultConfig`, `PROXY_CONFIG`, the `proxy.istio.io/config` annotation) \
are Istio's and are not repeated here; the order the sources apply in is in \
[configuration.md](configuration.md).\n";

fn flag_table<'a>(out: &mut String, command: &str, args: impl Iterator<Item = &'a clap::Arg>) {
    out.push_str("| flag | default | what it does | vs Istio |\n|---|---|---|---|\n");
    for a in args {
        if a.get_id() == "help" {
            continue;
        }
        let name = match (a.get_long(), a.get_short()) {
            (Some(l), Some(s)) => format!("`--{l}`, `-{s}`"),
            (Some(l), None) => format!("`--{l}`"),
            (None, _) => format!(
                "`{}` (positional)",
                a.get_value_names().map_or_else(
                    || a.get_id().to_string(),
                    |v| v
                        .iter()
                        .map(|s| s.to_string())
                        .collect::<Vec<_>>()
                        .join(" "),
                )
            ),
        };
        let defaults: Vec<String> = a
            .get_default_values()
            .iter()
            .map(|v| v.to_string_lossy().into_owned())
            .collect();
        let default = match defaults.as_slice() {
            [] => "none".to_owned(),
            [d] if d.is_empty() => "\"\"".to_owned(),
            ds => format!("`{}`", ds.join(",")),
        };
        let help = a
            .get_help()
            .map(|h| {
                h.to_string()
                    .replace('\n', " ")
                    .replace('|', "\\|")
                    .replace('<', "&lt;")
            })
            .unwrap_or_default();
        let long = a.get_long().unwrap_or_default();
        let istio = FLAG_DIFFERENCES
            .iter()
            .find(|(c, f, _)| *c == command && *f == long && !long.is_empty())
            .map_or(SAME, |(_, _, d)| *d);
        let _ = writeln!(out, "| {name} | {default} | {help} | {istio} |");
    }
}

/// Each variable read must have exactly one line, and each line a variable that is read.
fn check_vars(catalog: &BTreeMap<String, (String, String)>) -> Result<(), String> {
    let mut described = BTreeSet::new();
    let mut problems = Vec::new();
    for (_, _, vars) in SECTIONS {
        for (name, _, _) in *vars {
            if !described.insert(*name) {
                problems.push(format!("{name} has two lines"));
            }
            if !catalog.contains_key(*name) {
                problems.push(format!("{name} has a line but is not read by config::load"));
            }
        }
    }
    for name in catalog.keys() {
        if !described.contains(name.as_str()) {
            problems.push(format!(
                "{name} is read by config::load but has no line in crates/meshagent/src/reference.rs"
            ));
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems.join("\n"))
    }
}

/// The variables `istio-iptables` reads that are bound to no flag, found by running its
/// configuration over an environment that records each read.
fn iptables_env_only() -> Vec<String> {
    struct Recording(std::cell::RefCell<BTreeSet<String>>);
    impl EnvSource for Recording {
        fn get(&self, key: &str) -> Option<String> {
            self.0.borrow_mut().insert(key.to_owned());
            None
        }
        fn vars(&self) -> Vec<(String, String)> {
            Vec::new()
        }
    }
    let env = Recording(Default::default());
    let _ = crate::iptables::config::Config::from_args(&[], &env);
    let bound: BTreeSet<&str> = crate::iptables::config::flags()
        .into_iter()
        .flat_map(|f| f.env)
        .collect();
    env.0
        .into_inner()
        .into_iter()
        .filter(|e| !bound.contains(e.as_str()))
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::disallowed_methods,
        reason = "test code, not on the agent's runtime"
    )]
    /// A variable read without a line, or a line for a variable not read, stops the generation
    /// with the name.
    #[test]
    fn a_variable_without_its_line_fails_the_generation() {
        let mut catalog = crate::config::env_catalog();
        assert_eq!(
            catalog.get("SECRET_TTL"),
            Some(&("duration".to_owned(), "24h0m0s".to_owned()))
        );
        assert!(super::check_vars(&catalog).is_ok());
        catalog.insert("NEW_VAR".into(), ("bool".into(), "false".into()));
        let e = super::check_vars(&catalog).unwrap_err();
        assert!(
            e.contains("NEW_VAR is read by config::load but has no line"),
            "{e}"
        );
        catalog.remove("NEW_VAR");
        catalog.remove("TRUST_DOMAIN");
        let e = super::check_vars(&catalog).unwrap_err();
        assert!(e.contains("TRUST_DOMAIN has a line but is not read"), "{e}");
    }

    /// `docs/configuration-reference.md` is what `meshagent config-reference` prints.
    #[test]
    fn configuration_reference_is_current() {
        let generated = super::markdown().unwrap_or_else(|e| panic!("{e}"));
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../docs/configuration-reference.md"
        );
        let file = std::fs::read_to_string(path).unwrap_or_default();
        assert!(
            file == generated,
            "docs/configuration-reference.md is stale; regenerate it with\n  \
             cargo run -p meshagent -- config-reference > docs/configuration-reference.md"
        );
    }
}
