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

Names not in the binary's symbol table (valgrind's own) are dropped; glibc's functions are in
it (the agent links glibc statically), IFUNC resolvers under their IFUNC's name, the C run
time's entry under callgrind's `(below main)`. The list is grouped by the phases of a sidecar
agent's process each function ran in (start-up's first phase, its second, the steady state:
see `main`), the code only the other processes ran (proxyless, istio-iptables) after it, then
by how many of the profiled processes ran it (all of them first), and sorted by name within a
group, so regenerating it after a change gives a readable diff. The variants of CPU-dependent
routines (aws-lc's, glibc's string functions) that callgrind's virtual CPU did not pick follow.
"""

import pathlib
import re
import subprocess
import sys

# callgrind names a function once as `fn=(id) name` (or `cfn=` for a callee), then by id.
FN = re.compile(r"^c?fn=\(\d+\) (.+)$")


# The phases of one agent process, split where it releases its code pages: the wrapper has
# callgrind dump a part of the profile on entry to `code_pages::release` (`--dump-before`), so
# one process leaves `cg.<pid>.1`, `cg.<pid>.2`, ... and its last part as `cg.<pid>`, or only
# `cg.<pid>` when it never released (`istio-iptables`). Part 1 is start-up's first phase
# (configuration, bootstrap, servers, Envoy's spawn: the agent releases when Envoy is
# spawned), part 2 the second (the first certificate, Envoy's xDS and SDS streams, until the
# trim after ready), later parts the steady state (bursts, rotations, drain).
START, SECOND, STEADY = 1, 2, 4


def executed(profile_dir: pathlib.Path) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """Every executed function: the number of profiles (processes) that ran it, and the
    phases it ran in (a mask of START, SECOND, STEADY), in the sidecars' processes and in the
    others'.

    A sidecar's process is one whose profile has two parts or more before its last: it
    released its code pages when it spawned Envoy and again once ready. A proxyless agent
    (no Envoy) leaves one, `istio-iptables` none (its whole run is one part, START)."""
    runs: dict[str, int] = {}
    sidecar: dict[str, int] = {}
    other: dict[str, int] = {}
    files = sorted(profile_dir.glob("cg.*"))
    if not files:
        sys.exit(f"orderfile: no callgrind profiles (cg.*) in {profile_dir}")
    by_pid: dict[str, list[pathlib.Path]] = {}
    for f in files:
        by_pid.setdefault(f.name.split(".")[1], []).append(f)
    for parts in by_pid.values():
        names: set[str] = set()
        phases = sidecar if len(parts) >= 3 else other
        for f in parts:
            # The part's number is in its header (`part: N`); the last part, written at
            # exit, is the file without a number.
            text = f.read_text(errors="replace").splitlines()
            part = next((int(p[5:]) for p in text[:20] if p.startswith("part:")), 1)
            phase = START if part == 1 else SECOND if part == 2 else STEADY
            for line in text:
                m = FN.match(line)
                if m:
                    n = m.group(1)
                    if n.startswith("(below main)"):
                        # callgrind's name for the C run time's entry (`_start` calling
                        # `__libc_start_main`), which it does not name by symbol.
                        n = "_start"
                    names.add(n)
                    phases[n] = phases.get(n, 0) | phase
        for n in names:
            runs[n] = runs.get(n, 0) + 1
    return runs, sidecar, other


def functions(binary: pathlib.Path) -> dict[str, int]:
    out = subprocess.run(
        ["nm", "--defined-only", "-S", str(binary)], check=True, capture_output=True, text=True
    ).stdout
    syms: dict[str, int] = {}
    for line in out.splitlines():
        parts = line.split()
        # `i`: an IFUNC symbol, whose value is its resolver's address; callgrind names the
        # resolver by it (`memcpy`), and the resolvers run as the static agent relocates
        # itself, before `main`.
        if len(parts) == 4 and parts[2] in "tTwWi":
            syms[parts[3]] = int(parts[1], 16)
    if not syms:
        sys.exit(f"orderfile: {binary} has no symbol table (build it with -C strip=none)")
    return syms


# aws-lc picks its assembly per CPU at run time (cpuid). callgrind's virtual CPU lacks SHA-NI,
# ADX, VAES and AVX-512, so on real hardware other variants of the routines it saw run: every
# variant is listed (after the profiled functions). Those that never run on a given CPU are
# contiguous and untouched, so they cost no resident memory there.
CPU_VARIANT = re.compile(r"^aws_lc_.*(avx|sse|ssse3|shaext|adx|mulx|bmi|vaes|ifma|clmul)", re.I)

# glibc's string and memory functions are IFUNCs as well, resolved when the static agent
# relocates itself: callgrind's virtual CPU gets `__memmove_avx_unaligned_erms`, a CPU with
# AVX-512VL `__memmove_evex_unaligned_erms`. Every variant of a family the profile ran is
# listed, grouped by instruction set, so a CPU's own variants lie together.
GLIBC_VARIANT = re.compile(
    r"^__(\w+?)_(sse2|ssse3|sse4_1|sse4_2|sse42|avx2|avx512\w*?|avx|evex\w*?)(_|$)"
)
# s2n-bignum's routines in aws-lc come in pairs, `<name>` (BMI2 and ADX) and `<name>_alt`
# (without): callgrind's virtual CPU has no ADX, so it ran the other one of each pair.
ALT = "_alt"


def variants(hot: set[str], syms: dict[str, int]) -> list[str]:
    """The CPU-dependent variants of the functions the profile ran, which it did not run."""
    families = {m.group(1) for s in hot if (m := GLIBC_VARIANT.match(s))}
    glibc = []
    for s in syms.keys() - hot:
        m = GLIBC_VARIANT.match(s)
        if m and m.group(1) in families:
            glibc.append((m.group(2), s))
    alt = {s[: -len(ALT)] if s.endswith(ALT) else s + ALT for s in hot} & syms.keys()
    return [s for _, s in sorted(glibc)] + sorted(alt - hot)


def main() -> None:
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    binary, profile_dir, order = map(pathlib.Path, sys.argv[1:])
    syms = functions(binary)
    runs, sidecar, other = executed(profile_dir)
    hot = runs.keys() & syms.keys()
    # The sidecar's phases first: a pod's resident peak is its sidecar agent's start. The
    # agent releases its code pages between its phases, so what is resident in a phase is
    # the 64 KiB windows its own code faults in. Each phase's code is kept in one stretch:
    #   start+steady | start only | start+second | all three | second+steady | second only |
    #   steady only
    # so start-up's first phase (configuration, servers, Envoy's spawn, with ECDSA keys the
    # first certificate) runs the 1st to 4th stretches, the second (the first certificate
    # and xDS exchange) the 3rd to 6th, the steady state the 1st, 4th, 5th and 7th. The
    # phases are a sidecar process's own, not those of every profiled process together: a
    # function that `istio-iptables` runs at its start (its whole run) or a proxyless agent
    # runs before its first release, but a sidecar only later, must not pull its window
    # into the sidecar's first phase (that union put 2.9 MiB of windows under 1.6 MiB of
    # first-phase code).
    layout = {
        START | STEADY: 0,
        START: 1,
        START | SECOND: 2,
        START | SECOND | STEADY: 3,
        SECOND | STEADY: 4,
        SECOND: 5,
        STEADY: 6,
    }
    # Then the code only the other processes run (proxyless, istio-iptables), by their
    # phases. Within a group by how many profiled processes run a function, all of them
    # first (one pod runs one scenario: a sidecar with RSA or ECDSA keys against istiod,
    # proxyless, istio-iptables), then by name, so a regenerated file gives a readable diff.
    names = sorted(
        hot,
        key=lambda s: (
            (0, layout[sidecar[s]]) if s in sidecar else (1, other[s]),
            -runs[s],
            s,
        ),
    )
    names += variants(hot, syms)
    listed = set(names)
    names += sorted(s for s in syms.keys() - listed if CPU_VARIANT.search(s))
    order.write_text("".join(f"{s}\n" for s in names))
    hot_kib = sum(syms[s] for s in hot) / 1024
    all_kib = sum(syms.values()) / 1024
    kib = [sum(syms[s] for s in hot & sidecar.keys() if layout[sidecar[s]] == g) / 1024
           for g in range(7)]
    rest = sum(syms[s] for s in hot - sidecar.keys()) / 1024
    print(f"orderfile: {len(hot)} of {len(syms)} functions executed, "
          f"{hot_kib:.0f} of {all_kib:.0f} KiB of code (sidecar phase groups: "
          f"{' '.join(f'{k:.0f}' for k in kib)} KiB; other processes only: {rest:.0f} KiB); "
          f"{len(names)} names -> {order}")


if __name__ == "__main__":
    main()
