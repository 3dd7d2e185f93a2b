"""Instruction counts of a kernel's SASS, without a GPU: compiles cuda/FILE.cu for sm_90 with the
host's definitions (traits), disassembles one kernel and prints its loops (a backward branch and
its body: static instructions, HMMA among them) and the stretches between barriers of a chosen
address range. A loop's body counts once however often it runs: a step's instructions times its
trips is what a warp issues (docs/cuda-kernels.md quotes such counts).

Needs nvcc (13.0 here) and cuobjdump, which a CUDA toolkit has and Triton's wheel carries
(`pip download --no-deps triton`, then unzip triton/backends/nvidia/bin/cuobjdump; nothing is
installed). --packed compiles the chunked GDN kernels with every chunk taken as a whole chunk of
packed rows (the path of every chunk of a long segment but its first and last), so that the
per-row source path does not count.

    python benchmarks/sass_loops.py --kernel gdn_chunk_state_w16 --packed --cuobjdump /tmp/tr/bin/cuobjdump
    python benchmarks/sass_loops.py --kernel gdn_chunk_solve --segments 0x3000-0x5000
"""

import argparse
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from openjev.worker.cuda import traits

REPO = Path(__file__).resolve().parent.parent
PACKED_GUARD = "if (r0 >= s.tail && r0 + CH <= s.rows)"
LINE = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
BRANCH = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")


def disassemble(source: str, kernel: str, packed: bool, nvcc: str, cuobjdump: str) -> list[tuple[int, str]]:
    text = (REPO / "cuda" / f"{source}.cu").read_text()
    if packed:
        if PACKED_GUARD not in text:
            sys.exit(f"--packed: cuda/{source}.cu has no packed-chunk guard ({PACKED_GUARD})")
        text = text.replace(PACKED_GUARD, "if (true)")
    with tempfile.TemporaryDirectory() as tmp:
        # beside the real file's headers: a copy in cuda/ would be read by the tests and the lint
        cu, cubin = Path(tmp) / f"{source}.cu", Path(tmp) / "k.cubin"
        cu.write_text(text)
        subprocess.run(
            [nvcc, "-arch=sm_90", "-std=c++17", "-cubin", f"-I{REPO / 'cuda'}", *traits.compile_definitions()]
            + [str(cu), "-o", str(cubin)],
            check=True,
            stderr=subprocess.DEVNULL,
        )
        sass = subprocess.run([cuobjdump, "-sass", "-fun", kernel, str(cubin)], check=True, capture_output=True)
    rows = [(int(m.group(1), 16), m.group(2)) for m in map(LINE.match, sass.stdout.decode().splitlines()) if m]
    if not rows:
        sys.exit(f"no SASS for kernel {kernel} in cuda/{source}.cu")
    return rows


def opcode(text: str) -> str:
    words = text.split()
    return (words[1] if words[0].startswith("@") else words[0]).split(".")[0]


def loops(rows: list[tuple[int, str]]) -> list[tuple[int, int, int, int]]:
    """(first address, branch address, instructions, HMMA) of each backward branch's body."""
    found = []
    for at, text in rows:
        m = BRANCH.search(text)
        if m and int(m.group(1), 16) <= at:
            body = [t for a, t in rows if int(m.group(1), 16) <= a <= at]
            found.append((int(m.group(1), 16), at, len(body), sum(opcode(t) == "HMMA" for t in body)))
    return found


def segments(rows: list[tuple[int, str]], lo: int, hi: int) -> list[tuple[int, int, Counter]]:
    """The stretches of [lo, hi] that end at a barrier: (first, last address, opcode counts)."""
    out, current = [], []
    for at, text in rows:
        if lo <= at <= hi:
            current.append((at, text))
            if "BAR.SYNC" in text:
                out.append(current)
                current = []
    out.append(current)
    return [(s[0][0], s[-1][0], Counter(opcode(t) for _, t in s)) for s in out if s]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default="gdn_chunked", help="cuda/SOURCE.cu")
    parser.add_argument("--kernel", required=True)
    parser.add_argument("--packed", action="store_true", help="every chunk a whole chunk of packed rows")
    parser.add_argument("--segments", help="ADDR-ADDR (hex): the stretches between barriers there")
    parser.add_argument("--nvcc", default="nvcc")
    parser.add_argument("--cuobjdump", default="cuobjdump")
    args = parser.parse_args()
    rows = disassemble(args.source, args.kernel, args.packed, args.nvcc, args.cuobjdump)
    print(f"{args.kernel}: {len(rows)} instructions")
    for first, last, count, hmma in loops(rows):
        print(f"  loop {first:05x}-{last:05x}: {count:5d} instructions, {hmma:3d} HMMA")
    if args.segments:
        lo, hi = (int(x, 16) for x in args.segments.split("-"))
        for first, last, ops in segments(rows, lo, hi):
            top = " ".join(f"{k}:{v}" for k, v in ops.most_common(8))
            print(f"  {first:05x}-{last:05x} {sum(ops.values()):5d}: {top}")


if __name__ == "__main__":
    main()
