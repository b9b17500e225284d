"""A model's weights read piece by piece (model/weights.py): the same weights as mlx-lm's own load, and no
`mx.eval` of the load larger than a piece, so a load lets another model's engine thread take the GIL."""

from __future__ import annotations

import mlx.core as mx
import mlx_lm
from mlx.utils import tree_flatten

from kvwake.daemon.model import weights
from testkit.tinymodel import make_model_dir


def test_pieces_keep_order_and_stay_within_the_bound_unless_one_array_is_larger():
    arrays = [mx.zeros((n,), mx.uint8) for n in (10, 20, 5, 40, 3, 3)]
    groups = list(weights.pieces(arrays, most=30))
    assert [[a.size for a in g] for g in groups] == [[10, 20], [5], [40], [3, 3]]
    assert [a for g in groups for a in g] == arrays


def test_a_load_evaluates_its_weights_in_pieces_and_matches_mlx_lm(tmp_path, monkeypatch):
    folder = make_model_dir(tmp_path / "m")
    want_model, want_tokenizer = mlx_lm.load(str(folder))
    want = dict(tree_flatten(want_model.parameters()))
    most = max(v.nbytes for v in want.values())  # pieces of about one large tensor: many evals
    evals: list[int] = []
    real_eval = mx.eval

    def counted(*args):
        evals.append(sum(a.nbytes for a in args[0]))
        return real_eval(*args)

    monkeypatch.setattr(weights.mx, "eval", counted)  # mlx.core's own: any eval of the load is counted
    model, tokenizer = weights.load(str(folder), most=most)
    monkeypatch.undo()
    got = dict(tree_flatten(model.parameters()))
    assert len(evals) > 1 and max(evals) <= most, f"evals of {evals} bytes, a piece at most {most}"
    assert sum(evals) == sum(v.nbytes for v in want.values())
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert mx.array_equal(got[name], value).item(), f"{name} differs from mlx_lm.load's"
    assert tokenizer.encode("hello") == want_tokenizer.encode("hello")
