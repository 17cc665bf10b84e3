//! Microsoft Azure (pkg/bootstrap/platform/azure.go): detected from the DMI system vendor,
//! described by the instance metadata service (`GET /metadata/instance` with `Metadata: True`),
//! 5 s per request.

use std::collections::BTreeMap;
use std::time::Duration;

use http::Method;
use serde_json::{Map, Value};

use super::fetch::fetch;
use super::{Endpoints, Kind, Locality, Platform};

/// Istio's Azure client timeout (`defaultTimeout`).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// The API version Istio asks for unless the server lists a newer one.
pub const DEFAULT_API_VERSION: &str = "2019-08-15";
/// Metadata key prefix (`NewAzure`).
pub const PREFIX: &str = "azure_";

const INSTANCE_PATH: &str = "/metadata/instance";

/// Istio's `IsAzure`: `sys_vendor` contains "Microsoft Corporation".
pub async fn is_azure(ep: &Endpoints) -> bool {
    let path = ep.dmi_dir.join("sys_vendor");
    super::read_small(path)
        .await
        .contains("Microsoft Corporation")
}

async fn request(ep: &Endpoints, query: &str) -> Map<String, Value> {
    let path = format!("{INSTANCE_PATH}?{query}");
    match fetch(
        Method::GET,
        &ep.azure,
        &path,
        &[("Metadata", "True")],
        REQUEST_TIMEOUT,
    )
    .await
    {
        // Istio reads the body whatever the status (it only warns on a non-200).
        Ok(a) => serde_json::from_slice(&a.body).unwrap_or_default(),
        Err(e) => {
            tracing::warn!(error = %e, "Azure metadata request failed");
            Map::new()
        }
    }
}

/// Istio's `NewAzure`: the newest API version the server lists (string order, as Istio
/// compares), then the instance document.
pub async fn new(ep: &Endpoints) -> Platform {
    let versions = request(ep, "").await;
    let mut version = DEFAULT_API_VERSION.to_owned();
    if let Some(Value::Array(newest)) = versions.get("newest-versions") {
        for v in newest.iter().filter_map(Value::as_str) {
            if v > version.as_str() {
                version = v.to_owned();
            }
        }
    }
    let doc = request(ep, &format!("api-version={version}")).await;
    from_document(&doc)
}

/// The platform described by an instance metadata document.
pub fn from_document(doc: &Map<String, Value>) -> Platform {
    let empty = Map::new();
    let compute = doc
        .get("compute")
        .and_then(Value::as_object)
        .unwrap_or(&empty);
    let field = |k: &str| {
        compute
            .get(k)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned()
    };
    let mut metadata = BTreeMap::new();
    for (key, src) in [("name", "name"), ("location", "location"), ("vmId", "vmId")] {
        let v = field(src);
        if !v.is_empty() {
            metadata.insert(format!("{PREFIX}{key}"), v);
        }
    }
    for (k, v) in tags(compute) {
        metadata.insert(k, v);
    }
    Platform {
        kind: Kind::Azure,
        metadata,
        locality: Locality {
            region: field("location"),
            zone: field("zone"),
            sub_zone: String::new(),
        },
    }
}

/// `tagsList` (`[{name, value}]`) when present, else the `tags` string `k1:v1;k2:v2`; keys
/// get the prefix (`azureTags`).
fn tags(compute: &Map<String, Value>) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    if let Some(list) = compute.get("tagsList") {
        if let Some(list) = list.as_array() {
            for t in list {
                let name = t.get("name").and_then(Value::as_str).unwrap_or_default();
                let value = t.get("value").and_then(Value::as_str).unwrap_or_default();
                out.insert(format!("{PREFIX}{name}"), value.to_owned());
            }
        }
        return out;
    }
    if let Some(s) = compute.get("tags").and_then(Value::as_str) {
        for tag in s.split(';').filter(|t| !t.is_empty()) {
            let (k, v) = tag.split_once(':').unwrap_or((tag, ""));
            out.insert(format!("{PREFIX}{k}"), v.to_owned());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn document_fields_and_tags() {
        let doc = json!({"compute": {"name": "vm1", "location": "westus2", "vmId": "id-1",
            "zone": "2", "tags": "a:1;b:;c"}});
        let p = from_document(doc.as_object().unwrap());
        assert_eq!(p.metadata["azure_name"], "vm1");
        assert_eq!(p.metadata["azure_location"], "westus2");
        assert_eq!(p.metadata["azure_vmId"], "id-1");
        assert_eq!(p.metadata["azure_a"], "1");
        assert_eq!(p.metadata["azure_b"], "");
        assert_eq!(p.metadata["azure_c"], "");
        assert_eq!(
            (p.locality.region.as_str(), p.locality.zone.as_str()),
            ("westus2", "2")
        );
        let doc =
            json!({"compute": {"tags": "x:1", "tagsList": [{"name": "env", "value": "prod"}]}});
        let p = from_document(doc.as_object().unwrap());
        assert_eq!(
            p.metadata.get("azure_env").map(String::as_str),
            Some("prod")
        );
        assert!(!p.metadata.contains_key("azure_x"));
    }
}
