//! Cloud platform metadata for the proxy's node (pkg/bootstrap/platform): which cloud the
//! agent runs on, the metadata Istio puts in node metadata `PLATFORM_METADATA`, and the
//! locality it falls back to when the pod has no locality label.
//!
//! `CLOUD_PLATFORM` (`aws`, `azure`, `gcp`, `none`, any case) forces a platform; otherwise GCP,
//! AWS and Azure are probed concurrently and the first detected wins, within Istio's 5 s
//! (`DiscoverWithTimeout`). Every probe is bounded: AWS requests 100 ms each, Azure 5 s, GCP
//! detection inside the 5 s and its metadata fill at most another 5 s (the Go metadata
//! client's request timeout; Istio fills GCP metadata after discovery). An unreachable metadata
//! server costs at most the 5 s and is never an error: the platform is then unknown, as in
//! Istio. The agent runs discovery while identity starts, so it adds to start-up only what
//! outlasts that.
//!
//! Endpoints: GCP honours `GCE_METADATA_HOST` as Google's client does. The link-local
//! addresses and the DMI files can be moved with the test-only variables
//! `MESHAGENT_TEST_METADATA_ADDR` and `MESHAGENT_TEST_DMI_DIR` (see [`Endpoints`]), so tests
//! never talk to a real link-local address.

pub mod aws;
pub mod azure;
pub mod fetch;
pub mod gcp;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use crate::config::Config;

/// Istio's overall discovery timeout (pkg/bootstrap/platform/discovery.go `defaultTimeout`).
pub const DISCOVERY_TIMEOUT: Duration = Duration::from_secs(5);

/// The link-local metadata address shared by GCE, EC2 (IPv4) and Azure.
pub const LINK_LOCAL_METADATA: &str = "169.254.169.254";

/// Which cloud.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Unknown,
    Gcp,
    Aws,
    Azure,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Unknown => "none",
            Kind::Gcp => "gcp",
            Kind::Aws => "aws",
            Kind::Azure => "azure",
        }
    }
}

/// Envoy locality (`region`, `zone`, `sub_zone`); empty parts are left out of the node.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Locality {
    pub region: String,
    pub zone: String,
    pub sub_zone: String,
}

/// What discovery found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Platform {
    pub kind: Kind,
    /// Node metadata `PLATFORM_METADATA` (`gcp_*`, `aws_*`, `azure_*` keys).
    pub metadata: BTreeMap<String, String>,
    pub locality: Locality,
}

impl Platform {
    /// Istio's `Unknown` platform: no metadata, empty locality.
    pub fn unknown() -> Platform {
        Platform {
            kind: Kind::Unknown,
            metadata: BTreeMap::new(),
            locality: Locality::default(),
        }
    }
}

/// Where the probes go and what they read. Production values come from [`Endpoints::from_config`].
#[derive(Debug, Clone)]
pub struct Endpoints {
    /// GCE metadata server `host[:port]`: `GCE_METADATA_HOST`, else 169.254.169.254.
    pub gce_host: String,
    /// `GCE_METADATA_HOST` was set (Google's client then trusts that it runs on GCE).
    pub gce_host_from_env: bool,
    /// Address the GCE detection probe (`metadata.OnGCE`) sends its HTTP request to.
    pub gce_probe: String,
    /// Whether detection may also resolve `metadata.google.internal` (off when the test-only
    /// address override is set, so tests send no DNS queries).
    pub gce_dns_probe: bool,
    /// EC2 IMDS `host[:port]` over IPv4 and IPv6 (`[fd00:ec2::254]`).
    pub aws_v4: String,
    pub aws_v6: String,
    /// Azure IMDS `host[:port]`.
    pub azure: String,
    /// `/sys/class/dmi/id` (Azure's `sys_vendor`, GCE's `product_name`).
    pub dmi_dir: PathBuf,
    /// `/etc/resolv.conf` (the GKE zone in the search list).
    pub resolv_conf: PathBuf,
}

impl Endpoints {
    pub fn from_config(cfg: &Config) -> Endpoints {
        let p = &cfg.platform;
        let test = (!p.test_metadata_addr.is_empty()).then(|| p.test_metadata_addr.clone());
        let link_local = test
            .clone()
            .unwrap_or_else(|| LINK_LOCAL_METADATA.to_owned());
        Endpoints {
            gce_host: if p.gce_metadata_host.is_empty() {
                link_local.clone()
            } else {
                p.gce_metadata_host.clone()
            },
            gce_host_from_env: !p.gce_metadata_host.is_empty(),
            gce_probe: link_local.clone(),
            gce_dns_probe: test.is_none(),
            aws_v4: link_local.clone(),
            aws_v6: test.unwrap_or_else(|| "[fd00:ec2::254]".to_owned()),
            azure: link_local,
            dmi_dir: if p.test_dmi_dir.as_os_str().is_empty() {
                PathBuf::from("/sys/class/dmi/id")
            } else {
                p.test_dmi_dir.clone()
            },
            resolv_conf: cfg.dns.resolv_conf.clone(),
        }
    }
}

/// The inputs discovery reads from the configuration.
#[derive(Debug, Clone, Default)]
pub struct Settings {
    /// `CLOUD_PLATFORM`.
    pub cloud_platform: String,
    /// `GCP_METADATA`: `PROJECT_ID|PROJECT_NUMBER|CLUSTER_NAME|CLUSTER_LOCATION`.
    pub gcp_metadata: String,
    /// `GCP_QUOTA_PROJECT`.
    pub gcp_quota_project: String,
    /// Use the IPv6 EC2 endpoint (the proxy has an IPv6 address: Istio's `SupportsIPv6`).
    pub ipv6: bool,
}

/// Discovers the platform for `cfg` (see the module docs for the bounds).
pub async fn discover(cfg: &Config, ipv6: bool) -> Platform {
    let settings = Settings {
        cloud_platform: cfg.platform.cloud_platform.clone(),
        gcp_metadata: cfg.platform.gcp_metadata.clone(),
        gcp_quota_project: cfg.platform.gcp_quota_project.clone(),
        ipv6,
    };
    discover_with(&settings, &Endpoints::from_config(cfg), DISCOVERY_TIMEOUT).await
}

/// [`discover`] with explicit inputs and detection timeout.
pub async fn discover_with(s: &Settings, ep: &Endpoints, timeout: Duration) -> Platform {
    let forced = s.cloud_platform.to_ascii_lowercase();
    let p = match forced.as_str() {
        "aws" => aws::new(ep, s.ipv6).await,
        "azure" => azure::new(ep).await,
        "gcp" => gcp::new(s, ep).await,
        "none" => Platform::unknown(),
        other => {
            if !other.is_empty() {
                // Istio ignores values it does not know and discovers.
                tracing::warn!(
                    CLOUD_PLATFORM = %s.cloud_platform,
                    "unknown CLOUD_PLATFORM (expected aws, azure, gcp or none); discovering the platform"
                );
            }
            detect(s, ep, timeout).await
        }
    };
    tracing::info!(
        platform = p.kind.as_str(),
        metadata = %serde_json::to_string(&p.metadata).unwrap_or_default(),
        "platform"
    );
    p
}

/// Probes the three clouds at once; the first detected wins. AWS's and Azure's metadata is
/// fetched inside the race (Istio's goroutines send `NewAWS`/`NewAzure`), so it shares the
/// timeout; GCP's after it (Istio's lazy `Metadata()`), bounded on its own.
async fn detect(s: &Settings, ep: &Endpoints, timeout: Duration) -> Platform {
    use futures::StreamExt;
    use futures::future::{BoxFuture, FutureExt};
    enum Found {
        Gcp,
        Ready(Platform),
    }
    let probes: Vec<BoxFuture<'_, Option<Found>>> = vec![
        async { gcp::is_gcp(s, ep).await.then_some(Found::Gcp) }.boxed(),
        async {
            if aws::is_aws(ep, s.ipv6).await {
                Some(Found::Ready(aws::new(ep, s.ipv6).await))
            } else {
                None
            }
        }
        .boxed(),
        async {
            if azure::is_azure(ep).await {
                Some(Found::Ready(azure::new(ep).await))
            } else {
                None
            }
        }
        .boxed(),
    ];
    let race = async {
        let mut pending: futures::stream::FuturesUnordered<_> = probes.into_iter().collect();
        while let Some(found) = pending.next().await {
            if found.is_some() {
                return found;
            }
        }
        None
    };
    match tokio::time::timeout(timeout, race).await {
        Ok(Some(Found::Gcp)) => gcp::new(s, ep).await,
        Ok(Some(Found::Ready(p))) => p,
        Ok(None) => Platform::unknown(),
        Err(_) => {
            tracing::info!(
                timeout = %crate::logging::dur(timeout),
                "timed out waiting for platform detection, treating it as unknown"
            );
            Platform::unknown()
        }
    }
}

/// A small system file (DMI, resolv.conf) as text; empty if it cannot be read.
pub(crate) async fn read_small(path: PathBuf) -> String {
    match crate::fsio::read(path, 64 * 1024, Duration::from_secs(1)).await {
        Ok(b) => String::from_utf8_lossy(&b).into_owned(),
        Err(_) => String::new(),
    }
}
