#!/usr/bin/env python3
"""Offline validation of every manifest under deploy/ (run by `make deploy-validate`, part of
`make test`).

* Every YAML document with a `kind` is validated with kubernetes-validate in strict mode
  (unknown fields are errors) against each Kubernetes version Istio 1.30 supports.
* Kinds kubernetes-validate has no schema for are errors, except IstioOperator, which is
  checked against the strict schema of the fields this project uses (ISTIO_OPERATOR below);
  Helm values files (`values*.yaml`, no `kind`) are checked against the same `values` schema.
* Least privilege, for every pod template (Deployment, Pod, ...): no service account token
  mounted, containers without privilege escalation, with a read-only root filesystem, all
  capabilities dropped and non-root. The only exception is Istio's init container
  (`istio-init`), which may add NET_ADMIN and NET_RAW and nothing else. No RBAC objects: the
  agent needs no Kubernetes API access.
* The production image: every meshagent image a manifest names (`.../meshagent/proxyv2:TAG`) is
  the proxyv2-layered one (deploy/Dockerfile.proxyv2), tagged with the Istio version of its
  base, and that base is Istio's own `istio/proxyv2:<version>`: Istio's Envoy carries the
  Istio-only extensions istiod emits by default (`istio.stats`, metadata exchange, peer
  metadata), which the self-contained image's upstream Envoy lacks (Envoy would reject
  istiod's listeners and the pod would never be ready). The self-contained image is for
  devplane and tests only.

Exit status 1 with one line per problem (file, document, path) when anything fails.
"""

import pathlib
import re
import sys

import jsonschema
import kubernetes_validate
import yaml

# Istio 1.30's supported Kubernetes releases (istio.io "Supported Releases").
KUBERNETES_VERSIONS = ["1.32.0", "1.33.0", "1.34.0", "1.35.0", "1.36.0"]

IMAGE = {"type": "string", "pattern": r"^[a-z0-9.\-]+(:[0-9]+)?/[a-z0-9._/\-]+(:[A-Za-z0-9._\-]+|@sha256:[0-9a-f]{64})$"}
HELM_VALUES = {
    "type": "object",
    "additionalProperties": False,
    "required": ["global"],
    "properties": {
        "global": {
            "type": "object",
            "additionalProperties": False,
            "required": ["proxy", "proxy_init"],
            "properties": {
                "hub": {"type": "string"},
                "tag": {"type": "string"},
                "proxy": {"type": "object", "additionalProperties": False, "required": ["image"],
                          "properties": {"image": IMAGE}},
                "proxy_init": {"type": "object", "additionalProperties": False, "required": ["image"],
                               "properties": {"image": IMAGE}},
            },
        },
        "pilot": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "env": {"type": "object", "additionalProperties": {"type": "string"},
                        "properties": {"ENABLE_NATIVE_SIDECARS": {"enum": ["true", "false", "auto"]}}},
            },
        },
    },
}
ISTIO_OPERATOR = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "install.istio.io/v1alpha1"},
        "kind": {"const": "IstioOperator"},
        "metadata": {"type": "object", "additionalProperties": False, "required": ["name"],
                     "properties": {"name": {"type": "string"}, "namespace": {"type": "string"}}},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["values"],
            "properties": {
                "profile": {"enum": ["default", "demo", "minimal", "remote", "empty", "preview", "ambient"]},
                "hub": {"type": "string"},
                "tag": {"type": "string"},
                "values": HELM_VALUES,
            },
        },
    },
}

WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}
RBAC_KINDS = {"Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"}
INIT_CAPS = {"NET_ADMIN", "NET_RAW"}


def pod_spec(doc):
    kind = doc.get("kind")
    if kind == "Pod":
        return doc.get("spec") or {}
    if kind in WORKLOAD_KINDS:
        return ((doc.get("spec") or {}).get("template") or {}).get("spec") or {}
    if kind == "CronJob":
        return (((doc.get("spec") or {}).get("jobTemplate") or {}).get("spec") or {}).get("template", {}).get("spec") or {}
    return None


def least_privilege(spec):
    problems = []
    if spec.get("automountServiceAccountToken") is not False:
        problems.append("spec.automountServiceAccountToken must be false (no Kubernetes API access)")
    pod_sc = spec.get("securityContext") or {}
    for group in ("initContainers", "containers"):
        for c in spec.get(group) or []:
            name = c.get("name", "?")
            where = f"{group}[{name}].securityContext"
            sc = c.get("securityContext") or {}
            caps = sc.get("capabilities") or {}
            if sc.get("allowPrivilegeEscalation") is not False:
                problems.append(f"{where}.allowPrivilegeEscalation must be false")
            if sc.get("privileged"):
                problems.append(f"{where}.privileged must not be true")
            if "ALL" not in (caps.get("drop") or []):
                problems.append(f"{where}.capabilities.drop must contain ALL")
            added = set(caps.get("add") or [])
            if group == "initContainers" and name == "istio-init":
                if not added <= INIT_CAPS:
                    problems.append(f"{where}.capabilities.add may only hold NET_ADMIN and NET_RAW, has {sorted(added)}")
                continue
            # A restartPolicy: Always init container is a native sidecar: same rules as containers.
            if added:
                problems.append(f"{where}.capabilities.add must be empty, has {sorted(added)}")
            if sc.get("readOnlyRootFilesystem") is not True:
                problems.append(f"{where}.readOnlyRootFilesystem must be true")
            non_root = sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))
            uid = sc.get("runAsUser", pod_sc.get("runAsUser"))
            if non_root is not True and not (isinstance(uid, int) and uid > 0):
                problems.append(f"{where}: must run as non-root (runAsNonRoot: true or runAsUser > 0)")
            if uid == 0:
                problems.append(f"{where}.runAsUser must not be 0")
            if name == "istio-proxy" and (uid != 1337 or sc.get("runAsGroup", pod_sc.get("runAsGroup")) != 1337):
                problems.append(f"{where}: istio-proxy must run as uid/gid 1337")
    return problems


# The proxyv2-layered build's base (deploy/Dockerfile.proxyv2 `ARG BASE=`): Istio's own image.
ISTIO_BASE = re.compile(r"^(docker\.io/)?istio/proxyv2:(\d+\.\d+\.\d+)(-distroless)?$")
MESHAGENT_IMAGE = re.compile(r"/meshagent/proxyv2:([^@]+)$")


def layered_base(root):
    """The Istio version of Dockerfile.proxyv2's base, or a problem."""
    path = pathlib.Path(root) / "Dockerfile.proxyv2"
    try:
        text = path.read_text()
    except OSError as e:
        return None, f"{path}: {e}"
    m = re.search(r"^ARG BASE=(\S+)$", text, re.M)
    if not m:
        return None, f"{path}: no `ARG BASE=` line"
    base = ISTIO_BASE.match(m.group(1))
    if not base:
        return None, (f"{path}: BASE {m.group(1)!r} is not Istio's proxyv2 image "
                      "(docker.io/istio/proxyv2:<x.y.z>[-distroless]): only Istio's Envoy has the "
                      "extensions istiod emits")
    return base.group(2), None


def images(node, path=""):
    """Every string under an `image` key or a `sidecar.istio.io/proxyImage` annotation."""
    if isinstance(node, dict):
        for k, v in node.items():
            here = f"{path}/{k}"
            if k in ("image", "sidecar.istio.io/proxyImage") and isinstance(v, str):
                yield here, v
            else:
                yield from images(v, here)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from images(v, f"{path}/{i}")


def production_images(where, doc, version):
    problems = []
    for at, image in images(doc):
        m = MESHAGENT_IMAGE.search(image)
        if m and m.group(1) != version:
            problems.append(f"{where}: {at}: {image} is not the production image "
                            f"(.../meshagent/proxyv2:{version}, Dockerfile.proxyv2 on Istio's "
                            f"proxyv2:{version}); the self-contained image has upstream Envoy "
                            "without Istio's extensions and is for devplane and tests only")
    return problems


def check_document(path, index, doc, version=None):
    where = f"{path} (document {index})"
    if not isinstance(doc, dict):
        return [f"{where}: not a mapping"]
    if version is not None:
        prod = production_images(where, doc, version)
        if prod:
            return prod
    kind = doc.get("kind")
    if kind is None:
        if path.name.startswith("values"):
            return [f"{where}: Helm values: {e.message} at {'/'.join(map(str, e.path))}"
                    for e in jsonschema.Draft202012Validator(HELM_VALUES).iter_errors(doc)]
        return [f"{where}: no kind (only Helm values files, named values*.yaml, may omit it)"]
    if kind == "IstioOperator":
        return [f"{where}: IstioOperator: {e.message} at {'/'.join(map(str, e.path))}"
                for e in jsonschema.Draft202012Validator(ISTIO_OPERATOR).iter_errors(doc)]
    if kind in RBAC_KINDS:
        return [f"{where}: {kind}: meshagent and the samples need no Kubernetes API access; no RBAC objects here"]
    problems = []
    for version in KUBERNETES_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            return [f"{where}: Kubernetes {version} has no schema for {doc.get('apiVersion')}/{kind}"]
        except kubernetes_validate.ValidationError as e:
            problems.append(f"{where}: Kubernetes {version}: {e.message} at {'/'.join(map(str, e.path))}")
    spec = pod_spec(doc)
    if spec is not None:
        problems += [f"{where}: {kind}: {p}" for p in least_privilege(spec)]
    return problems


def main(root):
    files = sorted(p for p in pathlib.Path(root).rglob("*") if p.suffix in (".yaml", ".yml") and p.is_file())
    if not files:
        print(f"no manifests under {root}", file=sys.stderr)
        return 1
    version, problem = layered_base(root)
    problems, count = ([problem] if problem else []), 0
    for path in files:
        try:
            docs = list(yaml.safe_load_all(path.read_text()))
        except yaml.YAMLError as e:
            problems.append(f"{path}: invalid YAML: {e}")
            continue
        for i, doc in enumerate(docs):
            if doc is None:
                continue
            count += 1
            problems += check_document(path, i, doc, version)
    for p in problems:
        print(p, file=sys.stderr)
    print(f"{count} documents in {len(files)} files, Kubernetes {', '.join(KUBERNETES_VERSIONS)}: "
          f"{'FAILED, ' + str(len(problems)) + ' problems' if problems else 'ok'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).parent))
