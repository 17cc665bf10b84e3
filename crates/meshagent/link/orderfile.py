#!/usr/bin/env python3
"""Writes the agent's symbol ordering file from callgrind profiles.

Usage: orderfile.py <profiled binary, not stripped> <callgrind out dir> <order file>

Every function callgrind saw executed in the profiled binary is listed, one per line, by its
symbol name. `make agent` links through link/cc-ordered, which resolves the names against
the binary being linked (names whose rustc hash has changed since by their name without the
hash) and has lld place those functions first and together in .text (--symbol-ordering-file). Code
that runs then shares its 64 KiB fault-around windows with other code that runs, instead of
with code that never does, so fewer text pages become resident (docs/benchmarks-log.md, "Code
layout").

Names not in the binary's symbol table (libc, ld.so, valgrind's own) are dropped. The list
is grouped by how many of the profiled scenarios ran each function (all of them first) and
sorted by name within a group, so regenerating it after a change gives a readable diff.
"""

import pathlib
import re
import subprocess
import sys

# callgrind names a function once as `fn=(id) name` (or `cfn=` for a callee), then by id.
FN = re.compile(r"^c?fn=\(\d+\) (.+)$")


def executed(profile_dir: pathlib.Path) -> dict[str, int]:
    """Every executed function, with the number of profiles (processes) that ran it."""
    runs: dict[str, int] = {}
    files = sorted(profile_dir.glob("cg.*"))
    if not files:
        sys.exit(f"orderfile: no callgrind profiles (cg.*) in {profile_dir}")
    for f in files:
        names: set[str] = set()
        for line in f.read_text(errors="replace").splitlines():
            m = FN.match(line)
            if m:
                names.add(m.group(1))
        for n in names:
            runs[n] = runs.get(n, 0) + 1
    return runs


def functions(binary: pathlib.Path) -> dict[str, int]:
    out = subprocess.run(
        ["nm", "--defined-only", "-S", str(binary)], check=True, capture_output=True, text=True
    ).stdout
    syms: dict[str, int] = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[2] in "tTwW":
            syms[parts[3]] = int(parts[1], 16)
    if not syms:
        sys.exit(f"orderfile: {binary} has no symbol table (build it with -C strip=none)")
    return syms


# aws-lc picks its assembly per CPU at run time (cpuid). callgrind's virtual CPU lacks SHA-NI,
# ADX, VAES and AVX-512, so on real hardware other variants of the routines it saw run: every
# variant is listed (after the profiled functions). Those that never run on a given CPU are
# contiguous and untouched, so they cost no resident memory there.
CPU_VARIANT = re.compile(r"^aws_lc_.*(avx|sse|ssse3|shaext|adx|mulx|bmi|vaes|ifma|clmul)", re.I)


def main() -> None:
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    binary, profile_dir, order = map(pathlib.Path, sys.argv[1:])
    syms = functions(binary)
    runs = executed(profile_dir)
    hot = runs.keys() & syms.keys()
    # Functions every scenario runs first, then those fewer scenarios run: one pod runs one
    # scenario (a sidecar with RSA or ECDSA keys, proxyless, istio-iptables), so the code only
    # the others run is kept out of the windows its own code faults in. By name within a
    # group, so a regenerated file gives a readable diff.
    names = sorted(hot, key=lambda s: (-runs[s], s))
    names += sorted(s for s in syms.keys() - hot if CPU_VARIANT.search(s))
    order.write_text("".join(f"{s}\n" for s in names))
    hot_kib = sum(syms[s] for s in hot) / 1024
    all_kib = sum(syms.values()) / 1024
    print(f"orderfile: {len(hot)} of {len(syms)} functions executed, "
          f"{hot_kib:.0f} of {all_kib:.0f} KiB of code; {len(names)} names -> {order}")


if __name__ == "__main__":
    main()
