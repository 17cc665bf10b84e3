//! Bootstrap rendering: the built-in renderer against the custom-template path
//! (gtmpl) rendering the project's own template of the same default bootstrap
//! (tests/data/default_bootstrap.json.tmpl). This is the choice for the template Istio's
//! proxyv2 image ships at /var/lib/istio/envoy/envoy_bootstrap_tmpl.json: render it (as the
//! template path would) or use the built-in renderer. Reports time per render (median of 15
//! runs of 50 renders) and the ratio, both measured in this run.
//!
//! `cargo bench -p meshagent --bench bootstrap` (or `make bench`).
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used, clippy::print_stdout)] // a benchmark binary, not the agent

use std::path::Path;
use std::time::Duration;

use tokio::time::Instant;

use meshagent::bootstrap::{self, Node, template::Template};
use meshagent::config::{self, MapEnv, ProxyFlags};

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn time(mut f: impl FnMut()) -> Duration {
    let mut runs = vec![];
    for _ in 0..15 {
        let t = Instant::now();
        for _ in 0..50 {
            f();
        }
        runs.push(t.elapsed() / 50);
    }
    median(runs)
}

fn main() {
    let dir = tempfile::tempdir().unwrap();
    let env = MapEnv::from_pairs(
        [
            ("POD_NAME", "foo"),
            ("POD_NAMESPACE", "bar"),
            ("INSTANCE_IP", "10.3.3.3"),
            (
                "PROXY_CONFIG",
                r#"{"tracing":{"zipkin":{"address":"zipkin:9411"}}}"#,
            ),
            ("ISTIO_METAJSON_LABELS", r#"{"app":"a","version":"v1"}"#),
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned())),
    );
    let cfg = config::load(&ProxyFlags::default(), &env, dir.path()).unwrap();
    let node = Node::with_ips(&cfg, vec!["10.3.3.3".parse().unwrap()]).unwrap();
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/default_bootstrap.json.tmpl");
    let text = std::fs::read_to_string(&path).unwrap();

    let builtin = time(|| {
        let r = bootstrap::generate(&cfg, &node, None).unwrap();
        std::hint::black_box(r);
    });
    let tmpl = Template::parse(&text, &path).unwrap();
    let render_only = time(|| {
        let r = bootstrap::generate(&cfg, &node, Some(&tmpl)).unwrap();
        std::hint::black_box(r);
    });
    let parse_and_render = time(|| {
        let t = Template::parse(&text, &path).unwrap();
        let r = bootstrap::generate(&cfg, &node, Some(&t)).unwrap();
        std::hint::black_box(r);
    });
    println!("bootstrap render, built-in:                {builtin:?}");
    println!(
        "bootstrap render, template (render only):  {render_only:?}  ({:.1}x built-in)",
        render_only.as_secs_f64() / builtin.as_secs_f64()
    );
    println!(
        "bootstrap render, template (parse+render): {parse_and_render:?}  ({:.1}x built-in)",
        parse_and_render.as_secs_f64() / builtin.as_secs_f64()
    );
}
