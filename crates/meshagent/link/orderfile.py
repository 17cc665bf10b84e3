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
is grouped by the agent's phases each function ran in (start-up's first phase, its second,
the steady state: see `main`), then by how many of the profiled scenarios ran it (all of them
first), and sorted by name within a group, so regenerating it after a change gives a
readable diff.
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


def executed(profile_dir: pathlib.Path) -> tuple[dict[str, int], dict[str, int]]:
    """Every executed function: the number of profiles (processes) that ran it, and the
    phases it ran in (a mask of START, SECOND, STEADY)."""
    runs: dict[str, int] = {}
    phases: dict[str, int] = {}
    files = sorted(profile_dir.glob("cg.*"))
    if not files:
        sys.exit(f"orderfile: no callgrind profiles (cg.*) in {profile_dir}")
    by_pid: dict[str, list[pathlib.Path]] = {}
    for f in files:
        by_pid.setdefault(f.name.split(".")[1], []).append(f)
    for parts in by_pid.values():
        names: set[str] = set()
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
                    names.add(n)
                    phases[n] = phases.get(n, 0) | phase
        for n in names:
            runs[n] = runs.get(n, 0) + 1
    return runs, phases


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
    runs, phases = executed(profile_dir)
    hot = runs.keys() & syms.keys()
    # By phase first. The agent releases its code pages between its phases, so what is
    # resident in a phase is the 64 KiB windows its own code faults in: each phase's code is
    # kept in one stretch, start-up's first phase (low heap) before the second (the first
    # certificate and xDS exchange: the heap's high-water mark, so the resident peak) and the
    # steady state (what stays resident for the pod's life) after it:
    #   start only | start+second | second only | second+steady (+start) | steady only | rest
    # so the second phase runs code of the 2nd to 4th stretches, the steady state of the
    # 4th to 6th.
    layout = {
        START: 0,
        START | SECOND: 1,
        SECOND: 2,
        SECOND | STEADY: 3,
        START | SECOND | STEADY: 3,
        STEADY: 4,
        START | STEADY: 5,
    }
    # Then by how many scenarios run a function, all of them first: one pod runs one scenario
    # (a sidecar with RSA or ECDSA keys, proxyless, istio-iptables), so the code only the
    # others run is kept out of the windows its own code faults in. By name within a group,
    # so a regenerated file gives a readable diff.
    names = sorted(hot, key=lambda s: (layout[phases[s]], -runs[s], s))
    names += sorted(s for s in syms.keys() - hot if CPU_VARIANT.search(s))
    order.write_text("".join(f"{s}\n" for s in names))
    hot_kib = sum(syms[s] for s in hot) / 1024
    all_kib = sum(syms.values()) / 1024
    kib = [sum(syms[s] for s in hot if layout[phases[s]] == g) / 1024 for g in range(6)]
    print(f"orderfile: {len(hot)} of {len(syms)} functions executed, "
          f"{hot_kib:.0f} of {all_kib:.0f} KiB of code (by phase group: "
          f"{' '.join(f'{k:.0f}' for k in kib)} KiB); {len(names)} names -> {order}")


if __name__ == "__main__":
    main()
