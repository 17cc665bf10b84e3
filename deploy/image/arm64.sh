#!/usr/bin/env bash
# The linux/arm64 production image, built and checked on this x86_64 machine.
#
# The production image is Istio's proxyv2 with meshagent as /usr/local/bin/pilot-agent
# (deploy/Dockerfile.proxyv2: one COPY, so buildah builds it for another architecture without
# emulation). Istio publishes proxyv2 for arm64; this machine reaches no image registry, so the
# check layers onto a stand-in arm64 base holding only what the agent loads (ld.so, libc,
# libgcc_s from Debian's arm64 cross packages), then checks the result: the image config says
# arm64, and the binary in the unpacked rootfs runs under qemu-user (no binfmt needed) and
# renders exactly the rules of the x86_64 build.
#
#   deploy/image/arm64.sh ARM64_AGENT_BIN X86_AGENT_BIN WORKDIR IMAGE
set -euo pipefail
agent=$1 host_agent=$2 work=$3 image=$4
sysroot=/usr/aarch64-linux-gnu
rm -rf "$work" && mkdir -p "$work/base/rootfs/lib" "$work/ctx"

# The stand-in base: an arm64 rootfs with the dynamic loader and the two libraries the agent
# needs (readelf NEEDED: libc.so.6, libgcc_s.so.1), Istio's non-root user like proxyv2's.
root=$work/base/rootfs
for lib in ld-linux-aarch64.so.1 libc.so.6 libgcc_s.so.1; do cp -L "$sysroot/lib/$lib" "$root/lib/"; done
mkdir -p "$root/etc" "$root/usr/local/bin" "$root/tmp"
printf 'root:x:0:0:root:/root:/sbin/nologin\nistio-proxy:x:1337:1337::/home/istio-proxy:/sbin/nologin\n' > "$root/etc/passwd"
printf 'root:x:0:\nistio-proxy:x:1337:\n' > "$root/etc/group"
cat > "$work/base/Dockerfile" <<'D'
FROM scratch
COPY rootfs/ /
USER 1337:1337
WORKDIR /
ENTRYPOINT ["/usr/local/bin/pilot-agent"]
D
buildah bud --isolation chroot -q --arch arm64 --os linux -f "$work/base/Dockerfile" \
  -t "$image-base" "$work/base" >/dev/null

# The production Dockerfile, unchanged, for arm64.
install -m 0755 "$agent" "$work/ctx/meshagent"
buildah bud --isolation chroot -q --arch arm64 --os linux -f deploy/Dockerfile.proxyv2 \
  --build-arg BASE="$image-base" -t "$image" "$work/ctx" >/dev/null

arch=$(skopeo inspect --config "containers-storage:$image" | python3 -c 'import json,sys; c=json.load(sys.stdin); print(c["os"] + "/" + c["architecture"])')
[ "$arch" = linux/arm64 ] || { echo "image is $arch, expected linux/arm64" >&2; exit 1; }
echo "image $image: $arch"
skopeo copy -q "containers-storage:$image" "oci:$work/oci:check"
umoci unpack --image "$work/oci:check" "$work/bundle" >/dev/null
rootfs=$work/bundle/rootfs
file -b "$rootfs/usr/local/bin/pilot-agent" | grep -q 'ARM aarch64' || { echo "pilot-agent is not an arm64 binary" >&2; exit 1; }
run() { qemu-aarch64 -L "$rootfs" "$rootfs/usr/local/bin/pilot-agent" "$@"; }
echo "pilot-agent version (arm64, under qemu-aarch64): $(run version --short)"
# The same rules as the x86_64 build, for a few istio-init command lines (log timestamps aside).
strip_time() { sed -E 's/^[0-9T:.-]+Z\t//'; }
for args in "-p 15001 -z 15006 -u 1337 -m REDIRECT -i * -b * -d 15090,15021,15020" \
            "-p 15001 -z 15006 -u 1337 -m TPROXY -i 10.0.0.0/8 -x 10.1.0.0/16 -b 8080 -o 9090" \
            "-p 15001 -z 15006 -u 1337 -m REDIRECT -i * -b * --redirect-dns --capture-all-dns" ; do
  # shellcheck disable=SC2086 # word splitting of the flags is intended; globs are off below
  a=$(set -f; run istio-iptables --dry-run $args 2>&1 | strip_time)
  # shellcheck disable=SC2086
  b=$(set -f; "$host_agent" istio-iptables --dry-run $args 2>&1 | strip_time)
  if [ "$a" != "$b" ]; then
    diff <(echo "$a") <(echo "$b") >&2 || true
    echo "istio-iptables --dry-run $args: arm64 and x86_64 builds differ" >&2
    exit 1
  fi
done
echo "istio-iptables --dry-run: arm64 output equals x86_64's for 3 command lines"
