"""Products through cuBLASLt with an algorithm that does not split K, called through ctypes.

cuBLAS splits K for the MLP down product (27B: weight [5120, 17408]) below ~352 rows, so a row's
bits would depend on its launch's row count; the runner pads those products to 352 rows (gemm.py),
~100 us where the product of 96-320 rows needs far less. cuBLASLt lets us ask for an algorithm
with no workspace and take only one that reports no split of K: it then sums each output in k
order in one fp32 accumulator, the order of cuBLAS's own unsplit kernels, so rows keep the bits a
padded or long product gives them. gemm.lt_plan checks that bit for bit on the card at start,
for every algorithm at every row count it would serve, and picks the fastest by timing.

No extra package: the library is the one torch already loaded. Launches go on torch's current
stream, so they can be captured in CUDA graphs.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
from ctypes import POINTER, byref, c_float, c_int, c_int32, c_int64, c_size_t, c_uint32, c_uint64, c_void_p

import torch

# cublasLt.h / cublas_api.h / library_types.h (CUDA 12-13)
COMPUTE_32F, R_32F, R_16BF = 68, 0, 14
DESC_TRANSA, OP_T = 3, 1
PREF_MAX_WORKSPACE_BYTES = 1
CONFIG_SPLITK_NUM, CONFIG_REDUCTION_SCHEME = 2, 3
HEURISTICS = 16  # algorithms asked for per shape


class _Algo(ctypes.Structure):
    _fields_ = [("data", c_uint64 * 8)]


class _Heuristic(ctypes.Structure):
    _fields_ = [
        ("algo", _Algo),
        ("workspace_size", c_size_t),
        ("state", c_int),
        ("waves_count", c_float),
        ("reserved", c_int * 4),
    ]


def _check(status: int, what: str) -> None:
    if status:
        raise RuntimeError(f"cuBLASLt {what} failed with status {status}")


@functools.cache
def _library() -> ctypes.CDLL:
    """libcublasLt as torch loaded it (by soname), else from the nvidia wheels beside torch."""
    site = os.path.dirname(os.path.dirname(torch.__file__))
    candidates = ["libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"]
    candidates += sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib", "libcublasLt.so*")))
    errors = []
    for name in candidates:
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError as error:
            errors.append(str(error))
    else:
        raise OSError(f"libcublasLt not found: {errors}")
    vp = c_void_p
    lib.cublasLtCreate.argtypes = [POINTER(vp)]
    lib.cublasLtMatmulDescCreate.argtypes = [POINTER(vp), c_int, c_int]
    lib.cublasLtMatmulDescSetAttribute.argtypes = [vp, c_int, vp, c_size_t]
    lib.cublasLtMatrixLayoutCreate.argtypes = [POINTER(vp), c_int, c_uint64, c_uint64, c_int64]
    lib.cublasLtMatmulPreferenceCreate.argtypes = [POINTER(vp)]
    lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [vp, c_int, vp, c_size_t]
    lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [vp] * 7 + [c_int, POINTER(_Heuristic), POINTER(c_int)]
    lib.cublasLtMatmulAlgoConfigGetAttribute.argtypes = [POINTER(_Algo), c_int, vp, c_size_t, POINTER(c_size_t)]
    lib.cublasLtMatmul.argtypes = [vp] * 12 + [POINTER(_Algo), vp, c_size_t, vp]
    return lib


def _config(lib: ctypes.CDLL, algo: _Algo, attr: int) -> int:
    value, written = c_uint32(0), c_size_t(0)
    _check(lib.cublasLtMatmulAlgoConfigGetAttribute(byref(algo), attr, byref(value), 4, byref(written)), "config")
    return value.value


class UnsplitLinear:
    """x [M, K] @ w [N, K]^T -> bf16 [M, N] for one weight shape, by one of the algorithms
    cuBLASLt's heuristic offers with no workspace, no split of K and no reduction scheme: the
    one `chosen` for M (gemm.lt_plan), else the heuristic's first. `workspace_bytes` > 0 also
    admits algorithms that need up to that much workspace (one buffer, allocated here; still no
    split of K and no reduction scheme), `heuristics` how many the heuristic is asked for."""

    def __init__(self, n: int, k: int, workspace_bytes: int = 0, heuristics: int = HEURISTICS):
        self.n, self.k = n, k
        self.heuristics = heuristics
        self.workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device="cuda") if workspace_bytes else None
        self.lib = lib = _library()
        self.handle = c_void_p()
        _check(lib.cublasLtCreate(byref(self.handle)), "create")
        self.desc = c_void_p()
        _check(lib.cublasLtMatmulDescCreate(byref(self.desc), COMPUTE_32F, R_32F), "desc")
        trans = c_int32(OP_T)  # the weight is [N, K] row-major: column-major K x N, transposed
        _check(lib.cublasLtMatmulDescSetAttribute(self.desc, DESC_TRANSA, byref(trans), 4), "transa")
        self.w_layout = self._layout(k, n, k)
        self.pref = c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(byref(self.pref)), "preference")
        workspace = c_uint64(workspace_bytes)
        _check(lib.cublasLtMatmulPreferenceSetAttribute(self.pref, PREF_MAX_WORKSPACE_BYTES, byref(workspace), 8), "ws")
        self._found: dict[int, tuple[c_void_p, c_void_p, list[_Algo]]] = {}
        # per row count the algorithm gemm.linear sends its products to (set by gemm.lt_plan)
        self.chosen: dict[int, _Algo] = {}
        self.alpha, self.beta = c_float(1.0), c_float(0.0)

    def _layout(self, rows: int, cols: int, ld: int) -> c_void_p:
        layout = c_void_p()
        _check(self.lib.cublasLtMatrixLayoutCreate(byref(layout), R_16BF, rows, cols, ld), "layout")
        return layout

    @property
    def workspace_bytes(self) -> int:
        return 0 if self.workspace is None else self.workspace.numel()

    @property
    def _workspace_ptr(self) -> c_void_p | None:
        return None if self.workspace is None else c_void_p(self.workspace.data_ptr())

    @property
    def rows(self) -> frozenset[int]:
        return frozenset(self.chosen)

    def candidates(self, m: int) -> list[_Algo]:
        """The algorithms cuBLASLt's heuristic offers for M rows within the workspace, no split of K
        and no reduction scheme, best first (cached)."""
        if m not in self._found:
            x_layout, out_layout = self._layout(self.k, m, self.k), self._layout(self.n, m, self.n)
            found, count = (_Heuristic * self.heuristics)(), c_int(0)
            status = self.lib.cublasLtMatmulAlgoGetHeuristic(
                self.handle, self.desc, self.w_layout, x_layout, out_layout, out_layout, self.pref, self.heuristics,
                found, byref(count),
            )  # fmt: skip
            if status:  # e.g. not supported for this shape: no candidates here
                count.value = 0
            unsplit = [
                h.algo
                for h in found[: count.value]
                if h.state == 0
                and h.workspace_size <= self.workspace_bytes
                and _config(self.lib, h.algo, CONFIG_SPLITK_NUM) <= 1
                and _config(self.lib, h.algo, CONFIG_REDUCTION_SCHEME) == 0
            ]
            self._found[m] = (x_layout, out_layout, unsplit)
        return self._found[m][2]

    def __call__(self, x: torch.Tensor, w: torch.Tensor, algo: _Algo | None = None) -> torch.Tensor:
        """x @ w^T by `algo`, else the one chosen for M rows, else the heuristic's first."""
        m = x.shape[0]
        if w.shape != (self.n, self.k) or x.shape[1] != self.k:
            raise ValueError(f"x {tuple(x.shape)} and w {tuple(w.shape)} against a [{self.n}, {self.k}] plan")
        if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or not (x.is_contiguous() and w.is_contiguous()):
            raise ValueError("contiguous bf16 operands expected")
        found = self.candidates(m)
        algo = algo or self.chosen.get(m) or (found[0] if found else None)
        if algo is None:
            raise RuntimeError(f"cuBLASLt offers no unsplit algorithm for {m} x {self.n} x {self.k}")
        x_layout, out_layout, _ = self._found[m]
        out = torch.empty(m, self.n, dtype=torch.bfloat16, device=x.device)
        stream = c_void_p(torch.cuda.current_stream(x.device).cuda_stream)
        alpha, beta = byref(self.alpha), byref(self.beta)
        d, xp, wp = c_void_p(out.data_ptr()), c_void_p(x.data_ptr()), c_void_p(w.data_ptr())
        status = self.lib.cublasLtMatmul(
            self.handle, self.desc, alpha, wp, self.w_layout, xp, x_layout, beta, d, out_layout, d, out_layout,
            byref(algo), self._workspace_ptr, self.workspace_bytes, stream,
        )  # fmt: skip
        _check(status, "matmul")
        return out
