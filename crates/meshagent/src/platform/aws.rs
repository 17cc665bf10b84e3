//! Amazon EC2 (pkg/bootstrap/platform/aws.go): the instance metadata service, IMDSv2 first
//! (a session token from `PUT /latest/api/token`), IMDSv1 (no token) when no token comes back.
//! Every request has Istio's 100 ms timeout.

use std::time::Duration;

use http::Method;

use super::fetch::fetch;
use super::{Endpoints, Kind, Locality, Platform};

/// Istio's per-request timeout for the EC2 metadata service.
pub const REQUEST_TIMEOUT: Duration = Duration::from_millis(100);

pub const REGION: &str = "aws_region";
pub const AVAILABILITY_ZONE: &str = "aws_availability_zone";
pub const INSTANCE_ID: &str = "aws_instance_id";

const TOKEN_PATH: &str = "/latest/api/token";
const TOKEN_TTL_HEADER: &str = "X-aws-ec2-metadata-token-ttl-seconds";
const TOKEN_HEADER: &str = "X-aws-ec2-metadata-token";

/// One conversation with IMDS: the token (if IMDSv2 gave one) is reused for its requests.
struct Imds<'a> {
    authority: &'a str,
    token: Option<String>,
}

impl<'a> Imds<'a> {
    async fn open(ep: &'a Endpoints, ipv6: bool) -> Imds<'a> {
        let authority = if ipv6 { &ep.aws_v6 } else { &ep.aws_v4 };
        let token = match fetch(
            Method::PUT,
            authority,
            TOKEN_PATH,
            &[(TOKEN_TTL_HEADER, "60")],
            REQUEST_TIMEOUT,
        )
        .await
        {
            Ok(a) => a.ok_text().filter(|t| !t.is_empty()),
            Err(e) => {
                tracing::debug!(error = %e, "no IMDSv2 token; trying IMDSv1");
                None
            }
        };
        Imds { authority, token }
    }

    /// `GET /latest/meta-data/<path>`: the body of a 200, else `None`.
    async fn get(&self, path: &str) -> Option<String> {
        let full = format!("/latest/meta-data/{path}");
        let headers: Vec<(&str, &str)> = match &self.token {
            Some(t) => vec![(TOKEN_HEADER, t.as_str())],
            None => vec![],
        };
        match fetch(
            Method::GET,
            self.authority,
            &full,
            &headers,
            REQUEST_TIMEOUT,
        )
        .await
        {
            Ok(a) => a.ok_text(),
            Err(e) => {
                tracing::debug!(error = %e, "error getting AWS info");
                None
            }
        }
    }
}

/// Istio's `IsAWS`: `iam/info` answers and names an IAM ARN.
pub async fn is_aws(ep: &Endpoints, ipv6: bool) -> bool {
    let imds = Imds::open(ep, ipv6).await;
    imds.get("iam/info")
        .await
        .is_some_and(|info| info.contains("arn:aws:iam"))
}

/// Istio's `NewAWS`: region, availability zone and instance id (each left out if missing).
pub async fn new(ep: &Endpoints, ipv6: bool) -> Platform {
    let imds = Imds::open(ep, ipv6).await;
    let (region, az, id) = tokio::join!(
        imds.get("placement/region"),
        imds.get("placement/availability-zone"),
        imds.get("instance-id"),
    );
    let mut metadata = std::collections::BTreeMap::new();
    for (k, v) in [
        (AVAILABILITY_ZONE, &az),
        (REGION, &region),
        (INSTANCE_ID, &id),
    ] {
        if let Some(v) = v.as_ref().filter(|v| !v.is_empty()) {
            metadata.insert(k.to_owned(), v.clone());
        }
    }
    Platform {
        kind: Kind::Aws,
        metadata,
        locality: Locality {
            region: region.unwrap_or_default(),
            zone: az.unwrap_or_default(),
            sub_zone: String::new(),
        },
    }
}
