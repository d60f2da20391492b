"""Spike: what limits the cuda grid forward (N-D neighborhoods) on one GPU, by timing variants.

Each variant is the planned kernel (``jax_bindings._cuda.grid_tiles``) with one change:
``stages3`` (a K/V ring of 3), ``nomask`` (the per-element mask skipped on every tile: a timing
experiment, the output is not the attention). Times are JAX calls chained in one jitted program; useful
TFLOP/s count the mask's nonzeros.

    python benchmarks/spike_cuda_grid.py [--cases 2d15 2d63 3d] [--variants planned stages3 nomask]
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


@dataclasses.dataclass(frozen=True)
class Edited:
    """A grid variant whose source is edited by ``(old, new)`` (a spike's experiment)."""

    base: plan.GridFwdVariant
    old: str = ""
    new: str = ""

    @property
    def smem(self) -> int:
        return self.base.smem

    def compiled(self) -> tuple[str, bytes]:
        planned, text = self.base.named_source()
        if self.old:
            assert text.count(self.old) == 1, self.old
            text = text.replace(self.old, self.new)
        name, text = source.with_unique_name(text, kernel=planned)  # an edit gets its own name
        return name, compiler.cubin(text)


def variants(layout) -> dict[str, Edited]:
    base = plan.fwd_variant(layout, D, "bfloat16")
    return {
        "planned": Edited(base),
        "stages3": Edited(dataclasses.replace(base, stages=3)),
        "nomask": Edited(base, MASK_BRANCH, MASK_BRANCH.replace("if (edge)", "if (false)")),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="*", default=["2d15", "2d63", "3d"])
    ap.add_argument("--variants", nargs="*", default=["planned", "stages3", "nomask"])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for case in a.cases:
        grid, kern, kw = CASES[case]
        layout = masks.neighborhood(grid, kern, **kw).to_acsr()
        tiles = grid_tiles.grid_plan(layout.grid).tiles
        tables = jnp.asarray(grid_tiles.grid_plan(layout.grid).tables)
        s = layout.q_len
        q, k, v = (jnp.asarray(rng.standard_normal((1, s, H, D)), jnp.bfloat16) for _ in range(3))
        maps = plan.grid_tensor_maps(tiles, q.shape, k.shape, v.shape)
        ctas = plan.grid(q.shape, "strided", cb._sm_count(), tiles.n_patches)
        for vname in a.variants:
            var = variants(layout)[vname]
            if var.smem > source.SMEM_LIMIT:
                print(f"{case:6s} {vname:10s} needs {var.smem} bytes of shared memory: skipped", flush=True)
                continue
            name, image = var.compiled()

            def fwd(q, k, v, name=name, image=image, var=var, ctas=ctas, maps=maps, tables=tables):
                out, _ = cb.run_forward(name, image, ctas, var.smem, maps, q, k, v, SCALE, (tables,))
                return out

            ms = chained_ms(fwd, (q, k, v), {0: 0})
            tf = 4 * H * layout.nnz * D / ms / 1e9
            rows.append({"case": case, "variant": vname, "q_tile": tiles.q_tile, "k_tile": tiles.k_tile,
                         "ms": ms, "tflops": tf})
            print(f"{case:6s} {vname:10s} {ms:8.3f} ms {tf:7.1f} TF/s", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
