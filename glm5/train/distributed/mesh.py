"""`--mesh dp=2,tp=1,ep=1,pp=1`: the parallel layout of a distributed `glm5 train`, parsed and checked
against the process count before anything starts.

`ep` with `dp` places the experts across the data-parallel ranks (torchtitan's and Megatron's layout):
`dp=2,ep=2` is 2 processes, each with its own half of the batch and half of the experts, the routed
rows dispatched between them (SPEC 11.1); this build runs it with ep equal to dp.

`sp` is sequence parallel for the norms (glm5/parallel/sequence.py): not an axis of its own but a way of
running the tp ranks, so `tp=2,sp=2` is 2 processes (sp must equal tp), alone or under dp (`dp=2,tp=2,sp=2`).
"""

from __future__ import annotations

from dataclasses import dataclass

AXES = ("dp", "tp", "ep", "pp")
#: what runs over another axis's ranks without ranks of its own: sp over tp
OVER = {"sp": "tp"}
#: axes this build can run with a size above 1 (pp alone: glm5/train/distributed/pipeline/run.py)
RUNNABLE = ("dp", "tp", "ep", "pp")
#: the 2-D meshes it runs: data parallel (FSDP2) over copies of a model split by the plan (dp x tp), and
#: experts across the data-parallel ranks (dp with ep: ep borrows the dp ranks, no extra processes)
TWO_D = (("dp", "tp"), ("dp", "ep"))


@dataclass(frozen=True)
class Mesh:
    dp: int = 1
    tp: int = 1
    ep: int = 1
    pp: int = 1
    sp: int = 1

    @property
    def ep_over_dp(self) -> bool:
        """Experts across the data-parallel ranks: the ep ranks are dp ranks, each with its own tokens."""
        return self.dp > 1 and self.ep > 1

    @property
    def size(self) -> int:
        return self.dp * self.tp * self.pp * (1 if self.ep_over_dp else self.ep)

    @property
    def axis(self) -> str:
        """The first axis above 1 ('dp' for a single process)."""
        return next((a for a in AXES if getattr(self, a) > 1), "dp")

    @property
    def model_axis(self) -> str | None:
        """'tp' or 'ep' when the plan splits the model over that axis, else None."""
        return next((a for a in ("tp", "ep") if getattr(self, a) > 1), None)

    def __str__(self) -> str:
        return ",".join(f"{a}={getattr(self, a)}" for a in AXES) + (f",sp={self.sp}" if self.sp > 1 else "")


def parse_mesh(text: str) -> Mesh:
    """'dp=2' or 'dp=2,tp=1,ep=1,pp=1' -> Mesh (axes not named are 1); ValueError in one line otherwise."""
    sizes: dict[str, int] = {}
    for part in (p.strip() for p in text.split(",")):
        name, eq, value = part.partition("=")
        name = name.strip()
        if not eq or name not in (*AXES, *OVER):
            raise ValueError(
                f"expected AXIS=N[,AXIS=N...] with AXIS one of {', '.join((*AXES, *OVER))}, got {text!r}"
            )
        if name in sizes:
            raise ValueError(f"axis {name} given twice in {text!r}")
        try:
            sizes[name] = int(value)
        except ValueError:
            raise ValueError(f"{name}: expected an integer >= 1, got {value.strip()!r}") from None
        if sizes[name] < 1:
            raise ValueError(f"{name}: expected an integer >= 1, got {sizes[name]}")
    return Mesh(**sizes)


def check_mesh(mesh: Mesh, nproc: int) -> None:
    """The mesh must cover exactly the `nproc` processes, on axes this build runs."""
    if mesh.ep_over_dp and mesh.ep != mesh.dp:
        raise ValueError(
            f"ep={mesh.ep} with dp={mesh.dp}: experts across the data-parallel ranks need ep equal to dp "
            "in this build (each dp rank holds E / dp whole experts)"
        )
    if mesh.sp > 1 and mesh.sp != mesh.tp:
        raise ValueError(f"sp={mesh.sp}: sequence parallel runs over the tp ranks, expected tp={mesh.sp}")
    if mesh.size != nproc:
        borrowed = "; ep borrows the dp ranks" if mesh.ep_over_dp else ""
        raise ValueError(f"the axes multiply to {mesh.size} ({mesh}{borrowed}), expected --nproc ({nproc})")
    for axis in AXES:
        if axis not in RUNNABLE and getattr(mesh, axis) > 1:
            raise ValueError(f"{axis}={getattr(mesh, axis)}: not in this build yet (dp, tp, ep or pp)")
    used = tuple(a for a in AXES if getattr(mesh, a) > 1)
    if len(used) > 1 and used not in TWO_D:
        raise ValueError(
            f"{' x '.join(used)}: expected one axis above 1 or a 2-D mesh "
            f"{' or '.join(' x '.join(m) for m in TWO_D)}"
        )
