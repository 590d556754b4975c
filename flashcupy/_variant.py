"""A kernel variant (``Variant``: one compile-time specialization of a family, named by its key, with
the ``-D`` values it compiles with) and how it is built beyond its knobs (``Build``, ``kernel_build``:
the A/B experiments' changed defines or kernel folder)."""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
import os
import re

import numpy as np

from ._families import (
    ABLATIONS,
    DTYPES,
    FAMILIES,
    FP8_KSCALES,
    SCHEDULES,
    SMEM_LIMIT,
    TWIN_ABLATIONS,
    VARLEN_FAMILIES,
    Family,
)
from ._policy import wgmma_o_stage, wgmma_persistent, wgmma_schedule

__all__ = ["Build", "Variant", "current_build", "kernel_build"]


_DEFINE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclasses.dataclass(frozen=True)
class Build:
    """How a variant's module is compiled beyond what its knobs say: for experiments on the kernels
    themselves (``python -m analysis.ab`` times and compares builds in one process).

    ``defines`` (name, value) pairs are passed after the variant's own -D options and replace them;
    ``kernels_dir`` is a folder that holds the family's source and every header it includes, compiled
    in place of the package's kernels_cu/. The host side of a call stays the package's: each kernel is
    launched with the dynamic shared memory its module was compiled for (its FC_SMEM_<ROLE>, which a
    define may replace), and a switch that changes anything else the host does needs host code that
    reads it from ``KernelHandle.defines``.
    """

    defines: tuple[tuple[str, int], ...] = ()
    kernels_dir: str | None = None

    def __post_init__(self):
        if not isinstance(self.defines, tuple):
            raise TypeError(f"defines must be a tuple of (name, int) pairs, got "
                            f"{type(self.defines).__name__}")
        for pair in self.defines:
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise TypeError(f"defines must be (name, int) pairs, got {pair!r}")
            name, value = pair
            if not isinstance(name, str) or not _DEFINE_NAME.fullmatch(name):
                raise ValueError(f"a define's name must be a C identifier, got {name!r}")
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"define {name} must have an int value, got {value!r}")
        if len({name for name, _ in self.defines}) != len(self.defines):
            raise ValueError(f"each define may appear once, got {self.defines}")
        if self.kernels_dir is not None:
            if not isinstance(self.kernels_dir, str) or not os.path.isdir(self.kernels_dir):
                raise ValueError(f"kernels_dir must be an existing folder, got {self.kernels_dir!r}")
            object.__setattr__(self, "kernels_dir", os.path.abspath(self.kernels_dir))
        object.__setattr__(self, "defines", tuple(sorted(self.defines)))

    @property
    def label(self) -> str:
        """What a variant key gains: +NAME=value per define, @folder for a kernels folder."""
        parts = [f"+{n}={v}" for n, v in self.defines]
        if self.kernels_dir:
            parts.append("@" + self.kernels_dir)
        return "".join(parts)


_BUILD: contextvars.ContextVar[Build | None] = contextvars.ContextVar("flashcupy_build", default=None)


# current_build(): the Build that variants made now take (``kernel_build``), or None (the package's own).
# The ContextVar's own method, with no Python frame: the memoized checks of every call read it.
current_build = _BUILD.get


@contextlib.contextmanager
def kernel_build(defines: dict[str, int] | None = None, kernels_dir: str | None = None):
    """Inside this block every variant made, so every call of flashcupy made from this thread (the
    block is a ContextVar: threads started elsewhere, such as torch autograd's backward thread, run the
    package's kernels), compiles with these extra ``defines`` and from ``kernels_dir`` (see ``Build``);
    its modules, plans and memoized checks are their own, apart from the package's. Blocks do not nest
    into a merge: the inner one replaces the outer. With neither argument the block runs the package's
    own kernels. A ``kernels_dir`` must take the arguments this host passes (``_launch``'s argument
    layouts): a folder from a commit whose kernels have other parameter lists runs with wrong arguments
    (e.g. ``flash_bwd_prep`` takes ``dlse`` in every family since 215ec27)."""
    if defines is not None and not isinstance(defines, dict):
        raise TypeError(f"defines must be a dict of name -> int, got {type(defines).__name__}")
    build = Build(tuple((defines or {}).items()), kernels_dir)
    token = _BUILD.set(build if build != Build() else None)
    try:
        yield build
    finally:
        _BUILD.reset(token)


def _float32_cap(cap) -> float:
    """A softcap as the kernels hold it: the float32 nearest ``cap``, which must be finite and > 0
    (the checks of a call say so first, naming the argument)."""
    if isinstance(cap, bool) or not isinstance(cap, (int, float, np.floating, np.integer)):
        raise TypeError(f"softcap must be a number, got {type(cap).__name__}")
    cap32 = float(np.float32(cap))
    if not (math.isfinite(cap32) and cap32 > 0):
        raise ValueError(f"softcap must be a finite float32 > 0 in a Variant (0.0: none), got {cap!r}")
    return cap32


def _float32_bits(x: float) -> int:
    """The bits of float32 ``x`` as an int: how a float reaches a kernel as a -D value."""
    return int(np.float32(x).view(np.uint32))


@dataclasses.dataclass(frozen=True)
class Variant:
    """One compile-time specialization of a family. ``key`` names it everywhere."""

    family: str
    dtype: str
    accum: str
    block_m: int
    block_n: int
    head_dim: int
    causal: bool = False
    ablate: str | None = None
    # fwd_wgmma only: e4m3 operands with this accumulation of O ("single" / "tile", FP8_ACCUMULATIONS), and
    # k's descale per key tile or per key (FP8_KSCALES); the dtype is then the output's
    fp8: str | None = None
    fp8_kscale: str = "tile"
    # fwd_wgmma only: how the CTAs walk the tiles (SCHEDULES); None, or the value equal to it, is the
    # default for any length, wgmma_schedule(head_dim, causal)
    schedule: str | None = None
    # a sliding window (left, right) around i' = i + Nk - Nq (a side of -1: unbounded), compiled in
    # (FC_WINDOW): key j visible iff i' - left <= j <= i' + right; the causal window is causal=False
    # with right = 0, and (-1, 0) is causal=True (one form per mask: _checks.window_of); None: no window
    window: tuple[int, int] | None = None
    # flash_attn_func's softcap on the scaled scores, cap tanh(S / cap), compiled in (FC_SCORE_HOOK 2 with
    # the cap's float32 bits, FC_SOFTCAP_BITS): a float32 value > 0, or 0.0 for none (every family,
    # fp8 included; the kernels' hook and its tanh: kernels_cu/flash_common.cuh)
    softcap: float = 0.0
    # ALiBi (FC_ALIBI): a per-head linear bias -a |i' - j| on the scores after the softcap, the slopes a
    # given at launch (two more kernel parameters: the slopes in raw units and their batch stride); every
    # family but fp8
    alibi: bool = False
    # packed sequences (FC_VARLEN; VARLEN_FAMILIES, not fp8): batch entry b is sequence b of flash_attn's
    # packed (total, H, D) arrays, bounded by int32 cumulative lengths given at launch (four more kernel
    # parameters: kernels_cu/flash_common.cuh's batch entries); flashcupy.attention_varlen runs them
    varlen: bool = False
    # a paged KV cache read in place (FC_PAGED; fwd_wgmma varlen variants): the keys of each packed entry
    # through its row of a block table (three more kernel parameters: the table, each entry's row of
    # it, the page size, a multiple of block_n); attention_with_kvcache runs them
    paged: bool = False
    # compiled otherwise than the package does (experiments on the kernels; see Build). None: the
    # Build of the enclosing kernel_build block, if any
    build: Build | None = None

    def __post_init__(self):
        if self.build is None:
            object.__setattr__(self, "build", _BUILD.get())
        elif not isinstance(self.build, Build):
            raise TypeError(f"build must be a Build or None, got {type(self.build).__name__}")
        elif self.build == Build():  # the package's own: one key, one module
            object.__setattr__(self, "build", None)
        fam = FAMILIES.get(self.family)
        if fam is None:
            raise ValueError(f"unknown kernel family {self.family!r}; known: {sorted(FAMILIES)}")
        if self.fp8 is not None and self.family != "fwd_wgmma":
            raise ValueError(f"fp8 variants exist in fwd_wgmma only, not {self.family}")
        if self.fp8 is None:  # k's descale granularity means nothing without fp8: one key, one variant
            if self.fp8_kscale not in FP8_KSCALES:
                raise ValueError(f"fp8_kscale must be one of {FP8_KSCALES}, got {self.fp8_kscale!r}")
            object.__setattr__(self, "fp8_kscale", "tile")
        if self.dtype not in fam.dtypes:
            raise ValueError(f"{self.family} supports dtypes {fam.dtypes}, not {self.dtype!r}")
        if self.accum not in fam.accums(self.dtype):
            raise ValueError(f"{self.family} with {self.dtype} supports accum {fam.accums(self.dtype)}, "
                             f"not {self.accum!r}")
        if self.block_m not in fam.block_m or self.block_n not in fam.block_n:
            raise ValueError(f"{self.family} supports block_m in {fam.block_m} and block_n in "
                             f"{fam.block_n}; got block_m={self.block_m}, block_n={self.block_n}")
        if self.head_dim % 8 or not 8 <= self.head_dim <= 256:
            raise ValueError(f"head dim must be a multiple of 8 from 8 to 256, got {self.head_dim}")
        if self.ablate not in ABLATIONS:
            twin = f" ({self.ablate!r} runs on the NumPy twin only)" if self.ablate in TWIN_ABLATIONS else ""
            raise ValueError(f"ablate must be one of {ABLATIONS} in a kernel{twin}, got {self.ablate!r}")
        if self.schedule is not None:
            if self.family != "fwd_wgmma" or self.schedule not in SCHEDULES:
                raise ValueError(f"schedule must be None or, in fwd_wgmma, one of {SCHEDULES}; got "
                                 f"{self.schedule!r} in {self.family}")
            if self.schedule == wgmma_schedule(self.head_dim, self.causal):
                object.__setattr__(self, "schedule", None)  # one key per kernel
        if self.window is not None:
            from .reference import check_window

            window = check_window(self.window)
            if self.causal or window in ((-1, -1), (-1, 0)):
                raise ValueError(f"window must be None or a (left, right) other than (-1, -1) and (-1, 0) "
                                 f"(those are causal=False and causal=True) with causal=False (a causal "
                                 f"window has right = 0); got window={self.window!r}, causal={self.causal}")
            object.__setattr__(self, "window", window)
        if self.softcap != 0.0:
            cap = _float32_cap(self.softcap)
            object.__setattr__(self, "softcap", cap)
        if not isinstance(self.alibi, bool):
            raise TypeError(f"alibi must be a bool, got {type(self.alibi).__name__}")
        if self.alibi and self.fp8 is not None:
            raise ValueError("alibi_slopes do not run with fp8 operands yet; the 16-bit kernels run them")
        if not isinstance(self.varlen, bool):
            raise TypeError(f"varlen must be a bool, got {type(self.varlen).__name__}")
        if self.varlen and (self.family not in VARLEN_FAMILIES or self.fp8 is not None):
            raise ValueError(f"packed sequences (varlen) run in {', '.join(VARLEN_FAMILIES)}, not in "
                             f"{self.family}" + (" with fp8 operands" if self.fp8 else ""))
        if not isinstance(self.paged, bool):
            raise TypeError(f"paged must be a bool, got {type(self.paged).__name__}")
        if self.paged and not (self.varlen and self.family == "fwd_wgmma"):
            raise ValueError(f"a paged cache is read in place by fwd_wgmma's varlen variants, not by "
                             f"{self.family}" + ("" if self.varlen else " without varlen"))
        problem = fam.limits(self)
        if problem:
            raise ValueError(problem)

    @property
    def fam(self) -> Family:
        return FAMILIES[self.family]

    # fwd_wgmma's switches that follow from its fields by _policy's rules (0 in the other families),
    # computed once per variant: how its CTAs walk the tiles (FC_WG_PERSISTENT) and how o leaves the CTA
    # (FC_WG_O_STAGE); a Build's define of either replaces the rule's value
    @functools.cached_property
    def persistent(self) -> int:
        return wgmma_persistent(self) if self.family == "fwd_wgmma" else 0

    @functools.cached_property
    def o_stage(self) -> int:
        return wgmma_o_stage(self) if self.family == "fwd_wgmma" else 0

    @property
    def head_dim_pad(self) -> int:
        return self.fam.head_dim_pad(self.head_dim)

    @property
    def threads(self) -> int:
        return self.fam.threads(self)

    @property
    def roles(self) -> tuple[str, ...]:
        """The roles of the kernels this variant's module defines."""
        return self.fam.roles_of(self) if self.fam.roles_of else tuple(self.fam.roles)

    def kernel_name(self, role: str) -> str:
        """The name in the source of the kernel with this role, e.g. "dq" -> "flash_bwd_dq_mma"."""
        return self.fam.roles[role]

    @property
    def kernels(self) -> tuple[str, ...]:
        """The names of the kernels this variant's module defines."""
        return tuple(self.kernel_name(r) for r in self.roles)

    @property
    def smem_bytes(self) -> int:
        """The largest dynamic shared memory any kernel of the variant needs."""
        return max(self.smem_for(role) for role in self.roles)

    def smem_for(self, role: str) -> int:
        """Bytes of dynamic shared memory the kernel with this role is launched with."""
        return self.fam.smem_bytes(self, role)

    @property
    def key(self) -> str:
        parts = [self.family, self.dtype, "acc" + self.accum[2:], f"bm{self.block_m}",
                 f"bn{self.block_n}", f"d{self.head_dim}"]
        if self.causal:
            parts.append("causal")
        if self.window:
            parts.append("win{}_{}".format(*self.window))
        if self.softcap:
            # (the shortest decimal of the float32, its point written p: the key's parts are split by dots)
            cap = np.format_float_positional(np.float32(self.softcap), trim="-")
            parts.append("cap" + cap.replace(".", "p"))
        if self.alibi:
            parts.append("alibi")
        if self.varlen:
            parts.append("varlen")
        if self.paged:
            parts.append("paged")
        if self.ablate:
            parts.append("ablate_" + self.ablate)
        if self.fp8:
            parts.append(f"e4m3_{self.fp8}" + ("_kkey" if self.fp8_kscale == "key" else ""))
        if self.schedule:
            parts.append(self.schedule)
        return ".".join(parts) + (self.build.label if self.build else "")

    def __str__(self) -> str:
        return self.key

    def defines(self) -> dict[str, int]:
        """The -D options: the knobs, and each kernel's dynamic shared memory (FC_SMEM_<ROLE>) with the
        device limit (FC_SMEM_LIMIT), against which the kernels check their own layouts at compile time;
        last, the defines of the variant's Build, which replace any of these."""
        return {
            "FC_DTYPE": DTYPES[self.dtype][0],
            "FC_ACCUM_F16": int(self.accum == "fp16"),
            "FC_BLOCK_M": self.block_m,
            "FC_BLOCK_N": self.block_n,
            "FC_HEAD_DIM": self.head_dim,
            "FC_HEAD_DIM_PAD": self.head_dim_pad,
            "FC_NUM_THREADS": self.threads,
            "FC_CAUSAL": int(self.causal),
            "FC_WINDOW": int(self.window is not None),
            "FC_WINDOW_LEFT": self.window[0] if self.window else -1,
            "FC_WINDOW_RIGHT": self.window[1] if self.window else -1,
            **({"FC_SCORE_HOOK": 2, "FC_SOFTCAP_BITS": _float32_bits(self.softcap)} if self.softcap else {}),
            **({"FC_ALIBI": 1} if self.alibi else {}),
            **({"FC_VARLEN": 1} if self.varlen else {}),
            **({"FC_PAGED": 1} if self.paged else {}),
            "FC_ABLATE_MAX_SUBTRACTION": int(self.ablate == "max_subtraction"),
            "FC_ABLATE_RESCALING": int(self.ablate == "rescaling"),
            **{f"FC_SMEM_{role.upper()}": self.smem_for(role) for role in self.roles},
            **self.fam.extra_defines(self),
            "FC_SMEM_LIMIT": SMEM_LIMIT,
            **dict(self.build.defines if self.build else ()),
        }

    def switch(self, name: str, default: int) -> int:
        """A compile-time switch that the host follows too (a shared-memory layout, a grid): the value
        the variant's Build sets, else ``default``, the package's. Each formula of the host that depends
        on a switch reads it here, so a build may change the switch alone."""
        for n, value in self.build.defines if self.build else ():
            if n == name:
                return value
        return default

    def fits(self, smem_limit: int = SMEM_LIMIT) -> bool:
        return self.smem_bytes <= smem_limit

