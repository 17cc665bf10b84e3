//! Custom bootstrap templates: Go `text/template` semantics (checked case by case against what
//! Go's text/template and sprig produce), startup errors naming an unknown function or
//! parameter and its line, and a template of the project's own that reproduces the built-in
//! default bootstrap through the template path, validated by Envoy.
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::path::Path;
use std::process::Command;

use meshagent::bootstrap::{self, Node, template::Template};
use meshagent::config::{self, MapEnv, ProxyFlags};
use meshagent_testkit::envoy_bin;
use serde_json::{Value, json};

fn render(src: &str, params: Value) -> String {
    let t = Template::parse(src, Path::new("t.json")).unwrap_or_else(|e| panic!("{src}: {e}"));
    let Value::Object(p) = params else { panic!() };
    t.render(&p).unwrap_or_else(|e| panic!("{src}: {e}"))
}

/// Expected outputs are what Go's text/template (with sprig) prints for the same template and
/// data. Parameter names are Istio's (meshagent refuses others).
#[test]
fn go_template_semantics() {
    let p = json!({
        "cluster": "c", "zone": "", "nodeID": "n",
        "inclusionPrefix": ["a", "b"],
        "config": {"ProxyAdminPort": 15000, "ProxyMetadata": {"K": "v"}},
        "dual_stack": false, "envoy_status_port": 15021,
        "inclusionRegexps": ["x\\.y\"z"]
    });
    let cases = [
        // Trim markers eat the adjacent whitespace, newlines included.
        ("a  {{- .cluster -}}  b\n", "acb\n"),
        (
            "[\n  {{- range $i, $s := .inclusionPrefix }}\n  {{ $i }}={{ $s }},\n  {{- end }}\n]",
            "[\n  0=a,\n  1=b,\n]",
        ),
        (
            "{{ if .zone }}z{{ else if .cluster }}c{{ else }}none{{ end }}",
            "c",
        ),
        ("{{ with .cluster }}<{{ . }}>{{ end }}", "<c>"),
        ("{{ $x := .nodeID }}{{ $x }}{{ $.cluster }}", "nc"),
        (
            "{{ if and .cluster (eq .config.ProxyAdminPort 15000) }}y{{ end }}",
            "y",
        ),
        ("{{ if or .zone .dual_stack }}y{{ else }}n{{ end }}", "n"),
        ("{{ if not .dual_stack }}y{{ end }}", "y"),
        (
            "{{ len .inclusionPrefix }} {{ index .inclusionPrefix 1 }}",
            "2 b",
        ),
        (
            "{{ .config.ProxyMetadata.K }}|{{ .config.ProxyMetadata.NOPE }}",
            "v|<no value>",
        ),
        (
            "{{ printf \"%s-%d\" .cluster .envoy_status_port }}",
            "c-15021",
        ),
        ("{{ js (index .inclusionRegexps 0) }}", "x\\\\.y\\\"z"),
        ("{{/* a comment */}}ok", "ok"),
        ("{{ .cluster | printf \"%s!\" }}", "c!"),
        // sprig
        (
            "{{ .zone | default \"dz\" }} {{ .cluster | default \"dc\" }}",
            "dz c",
        ),
        ("{{ empty .zone }} {{ empty .cluster }}", "true false"),
        ("{{ toJson .inclusionPrefix }}", "[\"a\",\"b\"]"),
        ("{{ toJSON .config.ProxyMetadata }}", "{\"K\":\"v\"}"),
        ("{{ quote .cluster }} {{ squote .cluster }}", "\"c\" 'c'"),
        ("{{ ternary \"y\" \"n\" .dual_stack }}", "n"),
        (
            "{{ upper .cluster }}{{ lower \"X\" }}{{ trim \"  t \" }}",
            "Cxt",
        ),
        (
            "{{ trimPrefix \"ist\" \"istio\" }} {{ hasPrefix \"is\" \"istio\" }}",
            "io true",
        ),
        ("{{ join \",\" .inclusionPrefix }}", "a,b"),
        ("{{ replace \".\" \"/\" \"a.b.c\" }}", "a/b/c"),
        (
            "{{ index (dict \"k\" \"v\") \"k\" }} {{ hasKey .config \"ProxyAdminPort\" }}",
            "v true",
        ),
        ("{{ coalesce .zone .cluster }}", "c"),
        ("{{ range $i, $v := list 1 2 }}{{ $v }}{{ end }}", "12"),
    ];
    for (src, want) in cases {
        assert_eq!(render(src, p.clone()), want, "template {src:?}");
    }
}

#[test]
fn unknown_function_is_an_error_with_its_line() {
    let src = "{\n  \"a\": {{ .cluster }},\n  \"b\": {{ sha256sum .cluster }}\n}";
    let e = Template::parse(src, Path::new("/etc/t.json"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("/etc/t.json:3") && e.contains("\"sha256sum\"") && e.contains("not provided"),
        "{e}"
    );
    // Not fooled by strings or comments.
    assert!(Template::parse("{{ \"sha256sum\" }}{{/* nope() */}}", Path::new("t")).is_ok());
}

#[test]
fn unknown_parameter_is_an_error_with_its_line() {
    let src = "{\n\n  {{- if .stackdriverr }}x{{ end }}\n}";
    let e = Template::parse(src, Path::new("t.json"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("t.json:3") && e.contains(".stackdriverr"), "{e}");
    // Istio's names for features meshagent does not configure are known and empty.
    let t = Template::parse(
        "{{ if .stackdriver }}s{{ else }}none{{ end }}",
        Path::new("t"),
    )
    .unwrap();
    assert_eq!(t.render(&serde_json::Map::new()).unwrap(), "none");
    // Inside range/with the dot is rebound: `.x` is the element's field, not a parameter...
    assert!(
        Template::parse(
            "{{ range .inclusionPrefix }}{{ .whatever }}{{ end }}",
            Path::new("t")
        )
        .is_ok()
    );
    // ...but `$.x` is always the root.
    let e = Template::parse(
        "{{ range .inclusionPrefix }}\n{{ $.nope }}{{ end }}",
        Path::new("t"),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("t:2") && e.contains(".nope"), "{e}");
    // Fields of a parameter are not parameters.
    assert!(Template::parse("{{ .config.Anything }}", Path::new("t")).is_ok());
}

#[test]
fn parse_errors_name_the_template() {
    let e = Template::parse("{{ if .cluster }}unclosed", Path::new("bad.json"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("bad.json"), "{e}");
}

fn cfg(env: &[(&str, &str)], annotations: &[(&str, &str)], dir: &Path) -> config::Config {
    let mut e: Vec<(String, String)> = [
        ("POD_NAME", "foo"),
        ("POD_NAMESPACE", "bar"),
        ("INSTANCE_IP", "10.3.3.3"),
        ("SERVICE_ACCOUNT", "sa"),
    ]
    .iter()
    .chain(env)
    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
    .collect();
    e.dedup_by(|a, b| a.0 == b.0);
    if !annotations.is_empty() {
        let text: String = annotations
            .iter()
            .map(|(k, v)| format!("{k}={}\n", serde_json::to_string(v).unwrap()))
            .collect();
        std::fs::create_dir_all(dir.join("etc/istio/pod")).unwrap();
        std::fs::write(dir.join("etc/istio/pod/annotations"), text).unwrap();
    }
    config::load(&ProxyFlags::default(), &MapEnv::from_pairs(e), dir).unwrap()
}

/// The project's own default template, rendered through the template path (as
/// `ISTIO_BOOTSTRAP` would), equals the built-in renderer's output and is valid for Envoy.
#[test]
fn own_default_template_reproduces_the_builtin_bootstrap() {
    let tmpl_path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/default_bootstrap.json.tmpl");
    type Pairs = Vec<(&'static str, &'static str)>;
    let variants: Vec<(&str, Pairs, Pairs)> = vec![
        ("default", vec![], vec![]),
        (
            "zipkin_tls_metrics_statsd",
            vec![
                ("ISTIO_META_ENABLE_SELF_DISCOVERY", "true"),
                (
                    "PROXY_CONFIG",
                    r#"{"tracing":{"zipkin":{"address":"zipkin:9411"},"tlsSettings":{"mode":"SIMPLE","caCertificates":"/ca.pem"}},"envoyMetricsService":{"address":"ms:15000","tcpKeepalive":{"probes":3}},"envoyAccessLogService":{"address":"als:15001","tlsSettings":{"mode":"ISTIO_MUTUAL"}},"statsdUdpAddress":"10.1.1.1:8125","extraStatTags":["t1"],"statsCompression":false}"#,
                ),
            ],
            vec![
                (
                    "sidecar.istio.io/statsHistogramBuckets",
                    r#"{"istiocustom":[1,5]}"#,
                ),
                ("sidecar.istio.io/statsFlushInterval", "10s"),
            ],
        ),
        (
            "datadog_secure_hbone",
            vec![
                ("HOST_IP", "10.0.0.9"),
                (
                    "PROXY_CONFIG",
                    r#"{"tracing":{"datadog":{"address":"$(HOST_IP):8126"}},"proxyMetadata":{"METRICS_LOCALHOST_ACCESS_ONLY":"true"}}"#,
                ),
                ("ENVOY_SECURE_METRICS_PORT", "15091"),
                ("ENVOY_SECURE_MERGED_METRICS_PORT", "15092"),
                ("ENVOY_STATUS_PORT_ENABLE_PROXY_PROTOCOL", "true"),
                (
                    "ISTIO_METAJSON_LABELS",
                    r#"{"app":"a","topology.istio.io/locality":"r/z/s"}"#,
                ),
                (
                    "ISTIO_META_LOAD_STATS_CONFIG_JSON",
                    r#"{"api_type":"GRPC","grpc_services":[{"envoy_grpc":{"cluster_name":"xds-grpc"}}]}"#,
                ),
                ("EXIT_ON_ZERO_ACTIVE_CONNECTIONS", "true"),
            ],
            vec![(
                "sidecar.istio.io/statsInclusionRegexps",
                "http\\.[0-9]*\\.x",
            )],
        ),
    ];
    let tmpl = Template::load(&tmpl_path, &tmpl_path, "test").unwrap();
    for (name, env, ann) in variants {
        let dir = tempfile::tempdir().unwrap();
        let cfg = cfg(&env, &ann, dir.path());
        let node = Node::with_ips(&cfg, vec!["10.3.3.3".parse().unwrap()]).unwrap();
        let builtin = bootstrap::render(&cfg, &node).unwrap();
        let rendered = bootstrap::generate(&cfg, &node, Some(&tmpl)).unwrap();
        let via_template: Value = serde_json::from_str(&rendered.contents).unwrap_or_else(|e| {
            panic!(
                "{name}: template output is not JSON: {e}\n{}",
                rendered.contents
            )
        });
        // Numbers compare as protobuf does: 1 and 1.0 are the same double.
        assert_eq!(
            numbers_as_f64(via_template),
            numbers_as_f64(builtin),
            "{name}"
        );
        let file = bootstrap::write(&cfg, dir.path(), &rendered).unwrap();
        let out = Command::new(envoy_bin())
            .args([
                "--mode",
                "validate",
                "--disable-hot-restart",
                "-l",
                "error",
                "-c",
            ])
            .arg(dir.path().join(&file))
            .current_dir(dir.path())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// The template is chosen by `ISTIO_BOOTSTRAP` over `proxyBootstrapTemplatePath`; a YAML
/// template writes `envoy-rev.yaml`; a missing file is a startup error naming it.
#[test]
fn template_selection_and_output_name() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("a.yaml"), "node:\n  id: {{ .nodeID }}\n").unwrap();
    std::fs::write(
        dir.path().join("b.json"),
        "{\"node\": {\"id\": \"{{ .nodeID }}\"}}",
    )
    .unwrap();
    let c = cfg(
        &[
            ("ISTIO_BOOTSTRAP", "a.yaml"),
            ("PROXY_CONFIG", r#"{"proxyBootstrapTemplatePath":"b.json"}"#),
        ],
        &[],
        dir.path(),
    );
    let t = bootstrap::check_template(&c, dir.path()).unwrap().unwrap();
    let node = Node::with_ips(&c, vec!["10.3.3.3".parse().unwrap()]).unwrap();
    let r = bootstrap::generate(&c, &node, Some(&t)).unwrap();
    assert_eq!(r.file_name, "envoy-rev.yaml");
    assert_eq!(
        r.contents,
        "node:\n  id: sidecar~10.3.3.3~foo.bar~bar.svc.cluster.local\n"
    );

    let c = cfg(
        &[("PROXY_CONFIG", r#"{"proxyBootstrapTemplatePath":"b.json"}"#)],
        &[],
        dir.path(),
    );
    let t = bootstrap::check_template(&c, dir.path()).unwrap().unwrap();
    let r = bootstrap::generate(&c, &node, Some(&t)).unwrap();
    assert_eq!(r.file_name, "envoy-rev.json");

    // A missing template fails preflight (before anything starts, and `--dump-config`).
    let c = cfg(&[("ISTIO_BOOTSTRAP", "missing.json")], &[], dir.path());
    let e = meshagent::preflight::plan(&c, dir.path())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("missing.json") && e.contains("ISTIO_BOOTSTRAP"),
        "{e}"
    );

    let c = cfg(&[], &[], dir.path());
    assert!(bootstrap::check_template(&c, dir.path()).unwrap().is_none());
}

fn numbers_as_f64(v: Value) -> Value {
    match v {
        Value::Number(n) => json!(n.as_f64()),
        Value::Array(a) => Value::Array(a.into_iter().map(numbers_as_f64).collect()),
        Value::Object(o) => {
            Value::Object(o.into_iter().map(|(k, v)| (k, numbers_as_f64(v))).collect())
        }
        other => other,
    }
}
