#!/usr/bin/env python3
"""validate.py must fail on what it claims to catch: each case breaks one rule in a copy of a
real manifest from deploy/ and expects a problem naming it."""

import copy
import pathlib
import sys

import yaml

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import validate  # noqa: E402

HERE = pathlib.Path(__file__).parent


def docs(rel):
    return [d for d in yaml.safe_load_all((HERE / rel).read_text()) if d]


def deployment():
    return next(d for d in docs("examples/sidecar/httpbin.yaml") if d["kind"] == "Deployment")


def pod():
    return docs("reference/injected-sidecar-pod.yaml")[0]


def container(d, name):
    spec = d["spec"] if d["kind"] == "Pod" else d["spec"]["template"]["spec"]
    for group in ("initContainers", "containers"):
        for c in spec.get(group) or []:
            if c["name"] == name:
                return c
    raise KeyError(name)


def case(name, doc, expect, path=pathlib.Path("case.yaml")):
    problems = validate.check_document(path, 0, doc)
    ok = any(expect in p for p in problems)
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {problems if not ok else expect}")
    return ok


def case_v(name, doc, expect, version):
    problems = validate.check_document(pathlib.Path("case.yaml"), 0, doc, version)
    ok = any(expect in p for p in problems)
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {problems if not ok else expect}")
    return ok


def passes(name, doc):
    problems = validate.check_document(pathlib.Path("case.yaml"), 0, doc)
    print(f"{'ok  ' if not problems else 'FAIL'} {name}{': ' + str(problems) if problems else ''}")
    return not problems


def main():
    results = []
    d = deployment()
    results.append(passes("the sample Deployment passes", d))
    x = copy.deepcopy(d); x["spec"]["template"]["spec"]["containers"][0]["bogusField"] = 1
    results.append(case("unknown field (strict)", x, "bogusField"))
    x = copy.deepcopy(d); x["spec"]["replicas"] = "one"
    results.append(case("wrong type", x, "replicas"))
    x = copy.deepcopy(d); del x["spec"]["template"]["spec"]["automountServiceAccountToken"]
    results.append(case("token mounted", x, "automountServiceAccountToken"))
    x = copy.deepcopy(d); container(x, "httpbin")["securityContext"]["readOnlyRootFilesystem"] = False
    results.append(case("writable root", x, "readOnlyRootFilesystem"))
    p = pod()
    results.append(passes("the reference pod passes", p))
    x = copy.deepcopy(p); container(x, "istio-init")["securityContext"]["capabilities"]["add"].append("SYS_ADMIN")
    results.append(case("init with SYS_ADMIN", x, "NET_ADMIN and NET_RAW"))
    x = copy.deepcopy(p); container(x, "istio-proxy")["securityContext"]["runAsUser"] = 1000
    results.append(case("proxy not 1337", x, "1337"))
    x = copy.deepcopy(p); container(x, "istio-proxy")["securityContext"]["capabilities"]["add"] = ["NET_ADMIN"]
    results.append(case("proxy with a capability", x, "capabilities.add must be empty"))
    results.append(case("RBAC object", {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                                        "metadata": {"name": "x"}, "rules": []}, "no RBAC"))
    results.append(case("unknown CRD", {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}, "no schema"))
    io = docs("istio/istiooperator.yaml")[0]
    x = copy.deepcopy(io); x["spec"]["values"]["global"]["proxy"]["imag"] = "typo"
    results.append(case("IstioOperator typo", x, "imag"))
    x = copy.deepcopy(io); x["spec"]["values"]["global"]["proxy"]["image"] = "proxyv2"
    results.append(case("IstioOperator image without a registry", x, "does not match"))
    version, problem = validate.layered_base(HERE)
    results.append(problem is None and version is not None)
    print(("ok  " if results[-1] else "FAIL") + f"   Dockerfile.proxyv2 layers on Istio's proxyv2 {version}: {problem or ''}")
    x = copy.deepcopy(io); x["spec"]["values"]["global"]["proxy"]["image"] = "registry.example.com/meshagent/proxyv2:0.1.0"
    results.append(case_v("IstioOperator with the self-contained image", x, "not the production image", version))
    x = copy.deepcopy(p); container(x, "istio-proxy")["image"] = "registry.example.com/meshagent/proxyv2:dev"
    results.append(case_v("pod with the dev image", x, "not the production image", version))
    x = copy.deepcopy(deployment()); x["spec"]["template"]["metadata"].setdefault("annotations", {})["sidecar.istio.io/proxyImage"] = "r.example.com/meshagent/proxyv2:1.29.0"
    results.append(case_v("proxyImage annotation of another Istio version", x, "not the production image", version))
    bad = pathlib.Path(validate.__file__).parent / "Dockerfile.proxyv2"
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        (pathlib.Path(d) / "Dockerfile.proxyv2").write_text(bad.read_text().replace("docker.io/istio/proxyv2:", "docker.io/envoyproxy/envoy:v"))
        _, problem = validate.layered_base(d)
        results.append(problem is not None and "not Istio's proxyv2 image" in problem)
        print(("ok  " if results[-1] else "FAIL") + f"   a base that is not Istio's: {problem}")
    v = docs("istio/values.yaml")[0]
    x = copy.deepcopy(v); x["pilot"] = {"env": {"ENABLE_NATIVE_SIDECARS": True}}
    results.append(case("values: bool env", x, "ENABLE_NATIVE_SIDECARS", pathlib.Path("values-x.yaml")))
    print(f"{sum(results)}/{len(results)} cases")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
