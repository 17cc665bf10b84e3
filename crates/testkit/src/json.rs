//! Comparing JSON documents (config dumps) path by path.

use crate::Value;

/// Where two JSON values differ: each path (`.a.b[2].c`) with both values. Objects are
/// compared key by key (a missing key reads as `null`), arrays of equal length element by
/// element; anything else, and arrays of different lengths, as a whole.
pub fn json_diff(a: &Value, b: &Value) -> Vec<(String, Value, Value)> {
    fn walk(path: &str, a: &Value, b: &Value, out: &mut Vec<(String, Value, Value)>) {
        match (a, b) {
            (Value::Object(x), Value::Object(y)) => {
                let keys: std::collections::BTreeSet<_> = x.keys().chain(y.keys()).collect();
                for k in keys {
                    let (va, vb) = (
                        x.get(k).unwrap_or(&Value::Null),
                        y.get(k).unwrap_or(&Value::Null),
                    );
                    walk(&format!("{path}.{k}"), va, vb, out);
                }
            }
            (Value::Array(x), Value::Array(y)) if x.len() == y.len() => {
                for (i, (va, vb)) in x.iter().zip(y).enumerate() {
                    walk(&format!("{path}[{i}]"), va, vb, out);
                }
            }
            _ if a != b => out.push((path.to_owned(), a.clone(), b.clone())),
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk("", a, b, &mut out);
    out
}
