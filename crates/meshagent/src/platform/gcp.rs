//! Google Cloud (pkg/bootstrap/platform/gcp.go and Google's Go metadata client,
//! cloud.google.com/go/compute/metadata): `GCP_METADATA` or the GCE metadata server
//! (`GET /computeMetadata/v1/...` with `Metadata-Flavor: Google`), the zone from the GKE
//! search list in resolv.conf first.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Duration;

use http::Method;

use super::fetch::{dial, fetch};
use super::{Endpoints, Kind, Locality, Platform, Settings};

/// The Go metadata client's request timeout, and Istio's dial check
/// (`isMetadataEndpointAccessible`).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

pub const PROJECT: &str = "gcp_project";
pub const PROJECT_NUMBER: &str = "gcp_project_number";
pub const CLUSTER: &str = "gcp_gke_cluster_name";
pub const CLUSTER_URL: &str = "gcp_gke_cluster_url";
pub const LOCATION: &str = "gcp_location";
pub const INSTANCE: &str = "gcp_gce_instance";
pub const INSTANCE_ID: &str = "gcp_gce_instance_id";
pub const INSTANCE_TEMPLATE: &str = "gcp_gce_instance_template";
pub const INSTANCE_CREATED_BY: &str = "gcp_gce_instance_created_by";
pub const QUOTA_PROJECT: &str = "gcp_quota_project";
pub const ZONE: &str = "gcp_zone";

/// The GKE node's search list names its zone: `… us-central1-a.c.PROJECT.internal …`
/// (pkg/bootstrap/platform, Istio 1.25+, #54786), matched per line with Istio's expression
/// `^search.* ([^-]+-[^-]+-[^-]+)\.c\.[^.]+\.internal`. Matched by hand with the same
/// (leftmost-first, greedy) semantics: the regex crate would add ~1 MB to a binary whose pages
/// are its resident memory, for one expression read once at start.
fn zone_in_search_line(line: &str) -> Option<&str> {
    let rest = line.strip_prefix("search")?;
    // `.*` is greedy: the last space from which the rest matches wins.
    rest.match_indices(' ')
        .map(|(i, _)| i)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .find_map(|i| zone_at(&rest[i + 1..]))
}

/// `([^-]+-[^-]+-[^-]+)\.c\.[^.]+\.internal` at the start of `s`: the capture.
fn zone_at(s: &str) -> Option<&str> {
    let d1 = s.find('-').filter(|&d| d > 0)?;
    let d2 = s[d1 + 1..].find('-').filter(|&d| d > 0)? + d1 + 1;
    let c = d2 + 1;
    // The third part holds no `-`; greedy, so the last `.c.` whose tail matches wins.
    let c_end = s[c..].find('-').map_or(s.len(), |j| c + j);
    (c + 1..=c_end).rev().find_map(|p| {
        let tail = s.get(p..)?.strip_prefix(".c.")?;
        let dot = tail.find('.').filter(|&k| k > 0)?;
        tail[dot..].starts_with(".internal").then(|| &s[..p])
    })
}
/// `GCP_METADATA` split Istio's way: exactly four `|`-separated parts, else ignored.
pub fn parse_gcp_metadata(v: &str) -> Option<[String; 4]> {
    let parts: Vec<&str> = v.split('|').collect();
    match parts.as_slice() {
        [a, b, c, d] => Some([a, b, c, d].map(|s| (*s).to_owned())),
        _ => {
            if !v.is_empty() {
                tracing::warn!(
                    GCP_METADATA = v,
                    "GCP_METADATA is not PROJECT_ID|PROJECT_NUMBER|CLUSTER_NAME|CLUSTER_LOCATION; ignored"
                );
            }
            None
        }
    }
}

/// The zone in a resolv.conf's search list ([`crate::net::resolv`]: the last `search` line,
/// as glibc uses), if it has a GKE one.
pub fn zone_from_resolv_conf(text: &str) -> Option<String> {
    let search = crate::net::resolv::ResolvConf::parse(text).search;
    zone_in_search_line(&format!("search {}", search.join(" "))).map(str::to_owned)
}

/// Istio's `zoneToRegion`: everything before the last `-`.
pub fn zone_to_region(zone: &str) -> Option<&str> {
    zone.rsplit_once('-').map(|(r, _)| r)
}

/// Istio's `IsGCP`: `GCP_METADATA` is set, or `metadata.OnGCE()`.
pub async fn is_gcp(s: &Settings, ep: &Endpoints) -> bool {
    !s.gcp_metadata.is_empty() || on_gce(ep).await
}

/// Google's `OnGCE`: true when `GCE_METADATA_HOST` is set; else an HTTP probe of the metadata
/// address (answer header `Metadata-Flavor: Google`) raced with resolving
/// `metadata.google.internal` to that address. The first answer decides unless the DMI
/// product name says Google, in which case a "no" waits for the other probe.
pub async fn on_gce(ep: &Endpoints) -> bool {
    use futures::StreamExt;
    use futures::future::{BoxFuture, FutureExt};
    if ep.gce_host_from_env {
        return true;
    }
    let mut probes: Vec<BoxFuture<'_, bool>> = vec![
        async {
            match fetch(Method::GET, &ep.gce_probe, "/", &[], REQUEST_TIMEOUT).await {
                Ok(a) => {
                    a.headers
                        .get("Metadata-Flavor")
                        .and_then(|v| v.to_str().ok())
                        == Some("Google")
                }
                Err(_) => false,
            }
        }
        .boxed(),
    ];
    if ep.gce_dns_probe {
        probes.push(
            async {
                let lookup = tokio::net::lookup_host("metadata.google.internal.:80");
                match tokio::time::timeout(REQUEST_TIMEOUT, lookup).await {
                    Ok(Ok(addrs)) => {
                        let want: IpAddr =
                            super::LINK_LOCAL_METADATA.parse().expect("static address");
                        addrs.into_iter().any(|a| a.ip() == want)
                    }
                    _ => false,
                }
            }
            .boxed(),
        );
    }
    let product = super::read_small(ep.dmi_dir.join("product_name")).await;
    let try_harder = matches!(product.trim(), "Google" | "Google Compute Engine");
    let mut pending: futures::stream::FuturesUnordered<_> = probes.into_iter().collect();
    let Some(first) = pending.next().await else {
        return false;
    };
    if first || !try_harder {
        return first;
    }
    pending.next().await.unwrap_or(false)
}

/// `GET /computeMetadata/v1/<suffix>`: the trimmed body of a 200.
async fn get(ep: &Endpoints, suffix: &str) -> Option<String> {
    let path = format!("/computeMetadata/v1/{suffix}");
    match fetch(
        Method::GET,
        &ep.gce_host,
        &path,
        &[("Metadata-Flavor", "Google")],
        REQUEST_TIMEOUT,
    )
    .await
    {
        Ok(a) => {
            let v = a.ok_text();
            if v.is_none() {
                tracing::warn!(property = suffix, status = %a.status, "GCP metadata property not available");
            }
            v
        }
        Err(e) => {
            tracing::warn!(property = suffix, error = %e, "error fetching GCP metadata");
            None
        }
    }
}

/// `instance/zone` is `projects/NUMBER/zones/ZONE`; the client returns the last segment.
async fn zone(ep: &Endpoints) -> Option<String> {
    get(ep, "instance/zone")
        .await
        .map(|z| z.rsplit('/').next().unwrap_or_default().to_owned())
        .filter(|z| !z.is_empty())
}

/// Istio's `NewGCP` with its `Metadata()` and `Locality()`. The metadata server is used only
/// when it is reachable (`OnGCE` and a TCP dial within 5 s); `GCP_METADATA` values win over it,
/// and `GCP_QUOTA_PROJECT` is added either way.
pub async fn new(s: &Settings, ep: &Endpoints) -> Platform {
    let fill = on_gce(ep).await && dial(&ep.gce_host, REQUEST_TIMEOUT).await;
    if !fill {
        tracing::warn!(host = %ep.gce_host, "cannot reach the GCE metadata server; using GCP_METADATA only");
    }
    let mut md = BTreeMap::new();
    if let Some([pid, npid, cluster, location]) = parse_gcp_metadata(&s.gcp_metadata) {
        for (k, v) in [
            (PROJECT, pid),
            (PROJECT_NUMBER, npid),
            (LOCATION, location),
            (CLUSTER, cluster),
        ] {
            if !v.is_empty() {
                md.insert(k.to_owned(), v);
            }
        }
    }
    let resolv_zone = zone_from_resolv_conf(&super::read_small(ep.resolv_conf.clone()).await);
    let mut server_zone = None;
    if fill {
        let want = |k: &str| !md.contains_key(k);
        let (project, number, location, cluster, name, id, template, created_by, z) = tokio::join!(
            async {
                if want(PROJECT) {
                    get(ep, "project/project-id").await
                } else {
                    None
                }
            },
            async {
                if want(PROJECT_NUMBER) {
                    get(ep, "project/numeric-project-id").await
                } else {
                    None
                }
            },
            async {
                if !want(LOCATION) {
                    None
                } else if let Some(l) = get(ep, "instance/attributes/cluster-location").await {
                    Some(l)
                } else {
                    zone(ep).await
                }
            },
            async {
                if want(CLUSTER) {
                    get(ep, "instance/attributes/cluster-name").await
                } else {
                    None
                }
            },
            get(ep, "instance/name"),
            get(ep, "instance/id"),
            get(ep, "instance/attributes/instance-template"),
            get(ep, "instance/attributes/created-by"),
            async {
                if resolv_zone.is_none() {
                    zone(ep).await
                } else {
                    None
                }
            },
        );
        server_zone = z;
        for (k, v) in [
            (PROJECT, project),
            (PROJECT_NUMBER, number),
            (LOCATION, location),
            (CLUSTER, cluster),
            (INSTANCE, name),
            (INSTANCE_ID, id),
            (INSTANCE_TEMPLATE, template),
            (INSTANCE_CREATED_BY, created_by),
        ] {
            if let Some(v) = v {
                md.insert(k.to_owned(), v);
            }
        }
        if let (Some(p), Some(l), Some(c)) = (md.get(PROJECT), md.get(LOCATION), md.get(CLUSTER)) {
            let url = format!(
                "https://container.googleapis.com/v1/projects/{p}/locations/{l}/clusters/{c}"
            );
            md.insert(CLUSTER_URL.to_owned(), url);
        }
    }
    if !s.gcp_quota_project.is_empty() {
        md.insert(QUOTA_PROJECT.to_owned(), s.gcp_quota_project.clone());
    }
    let zone = resolv_zone.or(server_zone).unwrap_or_default();
    let mut locality = Locality::default();
    if let Some(region) = zone_to_region(&zone) {
        locality.region = region.to_owned();
        locality.zone = zone.clone();
    }
    if !zone.is_empty() {
        md.insert(ZONE.to_owned(), zone);
    }
    Platform {
        kind: Kind::Gcp,
        metadata: md,
        locality,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolv_conf_zone() {
        let gke = "nameserver 10.0.0.10\nsearch default.svc.cluster.local svc.cluster.local cluster.local us-central1-a.c.my-proj.internal c.my-proj.internal google.internal\noptions ndots:5\n";
        assert_eq!(zone_from_resolv_conf(gke).as_deref(), Some("us-central1-a"));
        assert_eq!(
            zone_from_resolv_conf("search us-east1-b.c.p.internal\n").as_deref(),
            Some("us-east1-b")
        );
        assert_eq!(
            zone_from_resolv_conf("search us-east1.c.p.internal\n"),
            None
        );
        assert_eq!(
            zone_from_resolv_conf("search x europe-west4-c.c.p.internal\n").as_deref(),
            Some("europe-west4-c")
        );
        assert_eq!(
            zone_from_resolv_conf("search cluster.local c.p.internal\n"),
            None
        );
        assert_eq!(zone_from_resolv_conf("nameserver 1.1.1.1\n"), None);
        // What the expression's classes allow: `[^-]` takes spaces and dots, greedy parts
        // take the last `.c.` that fits, `[^.]+` takes dashes.
        assert_eq!(
            zone_from_resolv_conf("search a-b-c d.c.x.internal\n").as_deref(),
            Some("a-b-c d")
        );
        assert_eq!(
            zone_from_resolv_conf("search a-b-c.c.d.c.my-p.internal\n").as_deref(),
            Some("a-b-c.c.d")
        );
        assert_eq!(
            zone_from_resolv_conf("search a-b-c.c.internal\n"),
            None,
            "[^.]+ needs a project"
        );
        // Read as glibc reads the file (Istio matches its expression on every line): a
        // `searchx` line is no search line, and of several `search` lines the last counts.
        assert_eq!(zone_from_resolv_conf("searchx a-b-c.c.p.internal\n"), None);
        assert_eq!(
            zone_from_resolv_conf("search a-b-c.c.p.internal\nsearch cluster.local\n"),
            None
        );
        assert_eq!(
            zone_from_resolv_conf("search cluster.local\nsearch x-y-z.c.p.internal # gke\n")
                .as_deref(),
            Some("x-y-z")
        );
    }

    #[test]
    fn gcp_metadata_needs_four_parts() {
        assert_eq!(
            parse_gcp_metadata("p|1|c|l"),
            Some(["p", "1", "c", "l"].map(String::from))
        );
        assert_eq!(parse_gcp_metadata("p|1|c"), None);
        assert_eq!(parse_gcp_metadata(""), None);
    }

    #[test]
    fn region_is_the_zone_without_its_suffix() {
        assert_eq!(zone_to_region("us-central1-a"), Some("us-central1"));
        assert_eq!(zone_to_region("nodash"), None);
    }
}
