"""splat._sparsify.indexing.operand_index: the index remapping both slice evaluators share."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from splat._sparsify.indexing import SHAPE_OPS, operand_index
from splat._sparsify.ir import build_ir
from splat._sparsify.symbolic import Form as _Form
from splat._sparsify.symbolic import Opaque as _Opaque

X = np.arange(2 * 1 * 6 * 5).reshape(2, 1, 6, 5)

CASES = {
    "broadcast_in_dim": lambda x: lax.broadcast_in_dim(x, (3, 2, 4, 6, 5), (1, 2, 3, 4)),
    "transpose": lambda x: jnp.transpose(x, (2, 0, 3, 1)),
    "reshape_size1": lambda x: x.reshape(2, 6, 1, 5, 1),
    "reshape_general": lambda x: x.reshape(4, 15),
    "squeeze": lambda x: lax.squeeze(x, (1,)),
    "slice": lambda x: lax.slice(x, (1, 0, 1, 0), (2, 1, 6, 5), (1, 1, 2, 3)),
    "rev": lambda x: lax.rev(x, (0, 2)),
}


def _node(f):
    """The one shape equation of ``f`` on X (input and output shapes included)."""
    ir = build_ir(jax.make_jaxpr(f)(jnp.asarray(X)))
    (node,) = ir.nodes
    assert node.prim.name in SHAPE_OPS
    return node, ir.shape(node.ins[0]), ir.shape(node.outs[0])


@pytest.mark.parametrize("case", sorted(CASES))
def test_numeric_index_reads_the_right_element(case):
    node, in_shape, out_shape = _node(CASES[case])
    y = np.asarray(CASES[case](jnp.asarray(X)))
    idx = tuple(np.indices(out_shape, sparse=True))
    src = operand_index(node.prim.name, node.params, in_shape, out_shape, idx)
    got = np.broadcast_to(X[tuple(i if in_shape[a] > 1 else 0 for a, i in enumerate(src))], out_shape)
    np.testing.assert_array_equal(got, y)


@pytest.mark.parametrize("case", sorted(set(CASES) - {"reshape_general"}))
def test_affine_forms_agree_with_numeric(case):
    """The symbolic pass gets the same operand index, as affine forms of (i, j)."""
    node, in_shape, out_shape = _node(CASES[case])
    forms = tuple(_Form(1, 0, 0) if a % 2 else _Form(0, 1, a) for a in range(len(out_shape)))
    src = operand_index(node.prim.name, node.params, in_shape, out_shape, forms)
    for i, j in [(0, 0), (1, 0), (0, 1), (2, 3)]:
        at = tuple(f.at(i, j) for f in forms)
        want = operand_index(node.prim.name, node.params, in_shape, out_shape, at)
        assert tuple(int(s.at(i, j)) if isinstance(s, _Form) else int(s) for s in src) == want


def test_general_reshape_is_opaque_to_forms():
    node, in_shape, out_shape = _node(CASES["reshape_general"])
    with pytest.raises(_Opaque):
        operand_index(node.prim.name, node.params, in_shape, out_shape, (_Form(1, 0, 0), _Form(0, 1, 0)))


def test_unknown_primitive_is_an_error():
    with pytest.raises(ValueError, match="not one of"):
        operand_index("gather", {}, (2,), (2,), (0,))
