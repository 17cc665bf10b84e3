#!/usr/bin/env bash
# Checks a built image without a container runtime: its config (skopeo inspect) has Istio's
# proxyv2 layout (WORKDIR /, ENTRYPOINT /usr/local/bin/pilot-agent, a non-root default user),
# and the binaries in the unpacked rootfs (skopeo copy + umoci unpack) run: meshagent answers
# as pilot-agent and as meshagent, Envoy, iptables (nft and legacy) and nft start.
#
#   deploy/image/check.sh IMAGE WORKDIR
set -euo pipefail
image=$1 work=$2
rm -rf "$work/oci" "$work/bundle"
cfg=$(skopeo inspect --config "containers-storage:$image")
python3 - "$cfg" <<'PY'
import json, sys
c = json.loads(sys.argv[1])["config"]
problems = []
if c.get("Entrypoint") != ["/usr/local/bin/pilot-agent"]:
    problems.append(f"Entrypoint {c.get('Entrypoint')}")
if c.get("WorkingDir") != "/":
    problems.append(f"WorkingDir {c.get('WorkingDir')!r}")
user = c.get("User", "")
if user.split(":")[0] in ("", "0", "root"):
    problems.append(f"User {user!r} (must be non-root)")
if problems:
    sys.exit("image config: " + "; ".join(problems))
print(f"image config ok: Entrypoint {c['Entrypoint']}, WorkingDir /, User {user}")
PY
skopeo inspect "containers-storage:$image" | python3 -c 'import json,sys; d=json.load(sys.stdin); print("layers:", len(d["Layers"]), "digest:", d["Digest"])'
skopeo copy -q "containers-storage:$image" "oci:$work/oci:check"
umoci unpack --image "$work/oci:check" "$work/bundle" >/dev/null
root=$work/bundle/rootfs
run() { chroot "$root" "$@"; }
echo "pilot-agent version: $(run /usr/local/bin/pilot-agent version --short)"
echo "meshagent version:   $(run /usr/local/bin/meshagent version --short)"
run /usr/local/bin/envoy --version | grep -q 'version:' && echo "envoy: $(run /usr/local/bin/envoy --version | grep version: | sed 's/.*version: //')"
for b in iptables iptables-nft-restore iptables-legacy-restore ip6tables-restore; do
  run /usr/sbin/$b --version >/dev/null
done
echo "iptables: $(run /usr/sbin/iptables --version)"
echo "nft: $(run /usr/sbin/nft --version)"
# istio-init's command, as far as it goes without a network namespace of its own: the dry run
# renders the rules with the image's own iptables.
run /usr/local/bin/pilot-agent istio-iptables --dry-run -p 15001 -z 15006 -u 1337 -m REDIRECT -i '*' -b '*' -d 15090,15021,15020 >/dev/null 2>&1
echo "istio-iptables --dry-run: ok"
# And for real, in a network namespace of its own (never the host's rules).
ns=meshagent-image-check-$$
ip netns add "$ns"
trap 'ip netns del "$ns" 2>/dev/null || true' EXIT
# A pod address (documentation range) on lo: istio-iptables picks IPv4/IPv6 from the pod's IPs.
ip -n "$ns" link set lo up
ip -n "$ns" addr add 198.51.100.2/32 dev lo
nsenter --net="/run/netns/$ns" chroot "$root" /usr/local/bin/pilot-agent istio-iptables \
  -p 15001 -z 15006 -u 1337 -m REDIRECT -i '*' -b '*' -d 15090,15021,15020 >/dev/null 2>&1
nsenter --net="/run/netns/$ns" chroot "$root" /usr/sbin/iptables-save -t nat | grep -q -- '-A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports 15001'
ip netns del "$ns"
trap - EXIT
echo "istio-iptables applied in a network namespace with the image's iptables: ok"
rm -rf "$work/oci" "$work/bundle"
