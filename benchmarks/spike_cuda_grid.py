"""Spike: what limits the cuda grid forward (N-D neighborhoods) on one GPU, by timing variants.

Each variant is a kernel on a tile shape (the planner's, ``jax_bindings._cuda.grid_tiles``, or
one of :data:`SHAPES`) with some changes: ``stages3`` (a K/V ring of 3), ``heads<g>`` (the
strided schedule taking ``g`` heads at a time; ``H``: all interleaved), ``nomask`` (the per-element mask
skipped on every tile: a timing experiment, the output is not the attention).
Every variant that computes attention is checked against the planned one. Times are JAX calls
chained in one jitted program; useful TFLOP/s count the mask's nonzeros.

    python benchmarks/spike_cuda_grid.py [--cases 2d15 2d63 3d] [--variants planned nomask heads1 ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
from cuda_spike_cases import SCALE, D, H, chained_ms
from spike_neighborhood import CASES

from jax_bindings._cuda import backend as cb
from jax_bindings._cuda import compiler, grid_tiles, plan, source
from splat import masks

MASK_BRANCH = "      if (edge) {\n        // key (column) c of the tile"
NOMASK = (MASK_BRANCH, MASK_BRANCH.replace("if (edge)", "if (false)"))
# other (q_tile, k_tile) shapes per case than the planner's
SHAPES = {
    "2d15": {"k4x32": ((1, 8, 16), (1, 4, 32))},
    "3d": {"k1x8x16": ((2, 8, 8), (1, 8, 16))},
}


@dataclasses.dataclass(frozen=True)
class Edited:
    """A grid variant on ``shape`` (None: the planner's) whose source is edited by ``(old, new)``
    (a spike's experiment)."""

    layout: object
    shape: tuple | None = None
    stages: int = 2
    heads: int | None = None  # heads a section of the schedule takes (None: the planner's)
    edits: tuple = ()  # (old, new) pairs

    @property
    def plan(self) -> grid_tiles.GridPlan:
        return grid_tiles.grid_plan(self.layout.grid, self.shape)

    @property
    def base(self) -> plan.GridFwdVariant:
        section = (plan.GRID_SECTION_BYTES if self.heads is None
                   else source.section_bytes_of(self.heads, self.layout.kv_len) if self.heads < H else 0)
        return plan.GridFwdVariant(self.plan.tiles, "bfloat16", stages=self.stages, section_bytes=section)

    @property
    def exact(self) -> bool:
        return NOMASK not in self.edits

    def compiled(self) -> tuple[str, bytes]:
        planned, text = self.base.named_source()
        for old, new in self.edits:
            assert text.count(old) == 1, old
            text = text.replace(old, new)
        name, text = source.with_unique_name(text, kernel=planned)  # an edit gets its own name
        return name, compiler.cubin(text)


def variants(case: str, layout) -> dict[str, Edited]:
    out = {"planned": Edited(layout), "stages3": Edited(layout, stages=3),
           "nomask": Edited(layout, edits=(NOMASK,))}
    for g in (1, 2, 4, 8, H):
        out[f"heads{g}"] = Edited(layout, heads=g)
        out[f"heads{g}-nomask"] = Edited(layout, heads=g, edits=(NOMASK,))
    for label, shape in SHAPES.get(case, {}).items():
        out[label] = Edited(layout, shape)
        out[f"{label}-nomask"] = Edited(layout, shape, edits=(NOMASK,))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="*", default=["2d15", "2d63", "3d"])
    ap.add_argument("--variants", nargs="*",
                    default=["planned", "nomask", "heads1", "heads2", "heads8", f"heads{H}"])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for case in a.cases:
        grid, kern, kw = CASES[case]
        layout = masks.neighborhood(grid, kern, **kw).to_acsr()
        s = layout.q_len
        q, k, v = (jnp.asarray(rng.standard_normal((1, s, H, D)), jnp.bfloat16) for _ in range(3))
        known = variants(case, layout)
        reference = None
        for vname in ["planned"] + [n for n in a.variants if n != "planned"]:
            if vname not in known:
                continue
            var = known[vname]
            if var.base.smem > source.SMEM_LIMIT:
                print(f"{case:6s} {vname:10s} needs {var.base.smem} bytes of shared memory: skipped",
                      flush=True)
                continue
            tiles, tables = var.plan.tiles, jnp.asarray(var.plan.tables)
            maps = plan.grid_tensor_maps(tiles, q.shape, k.shape, v.shape)
            ctas = plan.grid(q.shape, "strided", cb._sm_count(), tiles.n_patches)
            name, image = var.compiled()

            def fwd(q, k, v, name=name, image=image, var=var, ctas=ctas, maps=maps, tables=tables):
                out, _ = cb.run_forward(name, image, ctas, var.base.smem, maps, q, k, v, SCALE, (tables,))
                return out

            err = None
            if var.exact:
                out = np.asarray(jax.jit(fwd)(q, k, v), np.float32)
                if reference is None:
                    reference = out
                err = float(np.abs(out - reference).max())
            ms = chained_ms(fwd, (q, k, v), {0: 0})
            tf = 4 * H * layout.nnz * D / ms / 1e9
            rows.append({"case": case, "variant": vname, "q_tile": tiles.q_tile, "k_tile": tiles.k_tile,
                         "ms": ms, "tflops": tf, "max_diff_to_planned": err})
            print(f"{case:6s} {vname:16s} {tiles.q_tile} {tiles.k_tile} {ms:8.3f} ms {tf:7.1f} TF/s"
                  f" diff {err}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
