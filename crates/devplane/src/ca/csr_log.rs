//! The bounded log of `CreateCertificate` calls the debug endpoint serves.

use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;

use super::CSR_LOG_CAPACITY;
use crate::token::Identity;

/// What one `CreateCertificate` call carried, for the debug endpoint.
///
/// Never holds a raw token: `authorization` is reduced to a SHA-256 fingerprint.
#[derive(Clone, Debug, Serialize)]
pub struct CsrRecord {
    #[serde(serialize_with = "serialize_rfc3339")]
    pub time: SystemTime,
    /// `request.remote_addr()` (absent on transports without connect info, e.g. in-process).
    pub peer: Option<SocketAddr>,
    /// Request metadata; repeated keys are joined with `", "`, binary (`-bin`) values are base64.
    pub headers: BTreeMap<String, String>,
    /// The authenticated caller, if authentication succeeded.
    pub identity: Option<Identity>,
    /// The request's `metadata` Struct as JSON (`null` when absent).
    pub metadata: serde_json::Value,
    /// `validity_duration` as requested, in seconds.
    pub validity_requested_secs: i64,
    /// Serial (hex) of the issued leaf.
    pub serial: Option<String>,
    /// Why the call failed, if it did.
    pub error: Option<String>,
}

/// Bounded, shared log of the last [`CSR_LOG_CAPACITY`] CSR calls. Cheap to clone.
#[derive(Clone, Debug, Default)]
pub struct CsrLog {
    inner: Arc<Mutex<VecDeque<CsrRecord>>>,
}

impl CsrLog {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn push(&self, record: CsrRecord) {
        // A panic while holding the lock can't leave the deque inconsistent; keep logging.
        let mut q = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        if q.len() >= CSR_LOG_CAPACITY {
            q.pop_front();
        }
        q.push_back(record);
    }

    /// Oldest first.
    pub fn snapshot(&self) -> Vec<CsrRecord> {
        let q = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        q.iter().cloned().collect()
    }
}

fn serialize_rfc3339<S: serde::Serializer>(t: &SystemTime, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&rfc3339(*t))
}

/// UTC `YYYY-MM-DDTHH:MM:SS.mmmZ` (times before 1970 clamp to the epoch).
pub(crate) fn rfc3339(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs();
    let (days, sod) = (secs / 86_400, secs % 86_400);
    // Howard Hinnant's civil_from_days, for days since 1970-01-01 (non-negative here).
    let z = days as i64 + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        sod / 3600,
        sod % 3600 / 60,
        sod % 60,
        d.subsec_millis()
    )
}
