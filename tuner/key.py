"""The tuning key: what a winner is stored and looked up by."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from kernels.space import MAX_CARVEOUT, MAX_OVERLAP, InvalidConfig, check_operands, check_problem

# The collective an overlap key names (`overlap=allreduce:BYTES`).
OVERLAP_KIND = "allreduce"


def parse_overlap(text: str) -> int:
    """The bytes of `allreduce:BYTES`, the shape file's form of `Problem.overlap`."""
    kind, sep, count = text.partition(":")
    if kind != OVERLAP_KIND or not sep:
        raise ValueError(f"overlap takes {OVERLAP_KIND}:BYTES (the all-reduce beside the GEMM), got {text!r}")
    try:
        value = int(count)
    except ValueError:
        raise ValueError(f"overlap's bytes must be an integer, got {count!r}") from None
    if not 1 <= value <= MAX_OVERLAP:
        raise ValueError(f"overlap's bytes must be 1 to {MAX_OVERLAP}, got {value}")
    return value


def overlap_text(nbytes: int) -> str:
    """`Problem.overlap` written as a shape file writes it."""
    return f"{OVERLAP_KIND}:{nbytes}"


@dataclass(frozen=True)
class Problem:
    """A GEMM shape as a shape file or a call site states it, device not yet known.

    groups > 1 is a grouped GEMM. With `group_k` empty it is the MoE form
    (A of total M rows split into `groups`, every group sharing N and K); with
    `group_k` set it is seed 000's form, G problems of M x N with their own K
    (`k` is then the largest). `carveout` is the number of SMs another kernel
    holds while this GEMM runs (seed 003's scenario); `overlap` the bytes of
    an all-reduce that runs beside it (tensor parallelism; its choice is the
    one both finish soonest with), 0 for none.
    """

    m: int
    n: int
    k: int
    groups: int = 1
    dtype_in: str = "bf16"
    dtype_out: str = "bf16"
    layout: str = "tn"
    group_k: tuple[int, ...] = ()
    carveout: int = 0
    overlap: int = 0

    def __post_init__(self) -> None:
        check_operands(self.m, self.n, self.k, self.groups, self.dtype_in, self.dtype_out, self.layout)
        if self.group_k:
            if len(self.group_k) != self.groups:
                raise ValueError(f"{len(self.group_k)} per-group K values for {self.groups} groups")
            for gk in self.group_k:
                check_operands(self.m, self.n, gk, 1, self.dtype_in, self.dtype_out, self.layout)
            if self.k != max(self.group_k):
                raise ValueError("k must be the largest per-group K")
        if not 0 <= self.carveout <= MAX_CARVEOUT:
            raise InvalidConfig(f"held SMs must be 0 to {MAX_CARVEOUT}, got {self.carveout}")
        if not 0 <= self.overlap <= MAX_OVERLAP:
            raise InvalidConfig(f"overlap bytes must be 0 to {MAX_OVERLAP}, got {self.overlap}")
        if self.overlap and self.carveout:
            raise InvalidConfig("held SMs and an overlap both say what runs beside the GEMM: give one")

    def check(self, cfg) -> None:
        """Raise InvalidConfig if the pool config `cfg` cannot run this problem (the space's rules)."""
        check_problem(cfg, self.m, self.n, self.k, self.groups, self.dtype_in, self.dtype_out, self.layout,
                      self.group_k)

    def runs(self, cfg) -> bool:
        """Whether the pool config `cfg` can run this problem."""
        try:
            self.check(cfg)
        except InvalidConfig:
            return False
        return True

    @property
    def flops(self) -> float:
        if self.group_k:
            return 2.0 * self.m * self.n * sum(self.group_k)
        return 2.0 * self.m * self.n * self.k

    def label(self) -> str:
        k = ",".join(map(str, self.group_k)) if self.group_k else str(self.k)
        text = f"{self.m}x{self.n}x{k}"
        if self.groups > 1:
            text += f" g{self.groups}"
        if self.carveout:
            text += f" held{self.carveout}"
        if self.overlap:
            text += f" {overlap_text(self.overlap)}"
        return text


@dataclass(frozen=True)
class Key:
    """(arch, device, dtypes, layout, M, N, K, groups): the unit of tuning."""

    arch: str
    device: str
    problem: Problem

    def study_name(self) -> str:
        p = self.problem
        k = "-".join(map(str, p.group_k)) if p.group_k else str(p.k)
        name = (
            f"{self.arch}:{self.device}:{p.dtype_in}>{p.dtype_out}:{p.layout}:"
            f"{p.m}x{p.n}x{k}:g{p.groups}"
        )
        name += f":held{p.carveout}" if p.carveout else ""
        return name + (f":{overlap_text(p.overlap)}" if p.overlap else "")

    def with_m(self, m: int) -> "Key":
        return replace(self, problem=replace(self.problem, m=m))

    def to_dict(self) -> dict:
        d = asdict(self.problem)
        d["group_k"] = list(self.problem.group_k)
        return {"arch": self.arch, "device": self.device, **d}

    @classmethod
    def from_dict(cls, d: dict) -> "Key":
        """The inverse of `to_dict` (a stored key's fields; records written
        before overlap keys existed have no `overlap`: none)."""
        fields = {f: d[f] for f in ("m", "n", "k", "groups", "dtype_in", "dtype_out", "layout", "carveout")}
        return cls(d["arch"], d["device"], Problem(**fields, group_k=tuple(d["group_k"]), overlap=d.get("overlap", 0)))
