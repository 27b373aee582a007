"""``simulate bound``: draft lengths per request class against one length a step, on the roofline's
ragged step cost."""

import json

import numpy as np
import pytest

from serve_app.control.steps import expected_tokens
from serve_app.tools.simulate.__main__ import main
from serve_app.tools.simulate.bound import best, bound, step_ms
from serve_app.tools.simulate.curves import load_curve
from serve_app.tools.simulate.traces import RequestClass, parse_classes


def tokens(*acceptances, top=5):
    return np.array([[expected_tokens(a, k) for k in range(top + 1)] for a in acceptances])


@pytest.mark.parametrize("batch", [1, 16, 128])
@pytest.mark.parametrize("k", [0, 1, 3, 5])
def test_a_step_of_one_length_is_the_roofline_curves_step(batch, k):
    curve = load_curve("h200-8b-roofline")
    # the curve's step time: tokens per step over a request's rate (its prefill counted apart)
    tau = curve.tokens_per_step(k)
    rate, _ = curve.tables([k], batch)
    assert step_ms((batch,), (k,)) == pytest.approx(1000 * tau / rate[0, batch], rel=1e-3)


def test_a_ragged_step_pays_for_the_tokens_it_feeds():
    # 10 sequences at 3 drafts and 10 at none: cheaper than all 20 at 3, dearer than all at 0
    ragged = step_ms((10, 10), (3, 0))
    assert step_ms((10, 10), (0, 0)) < ragged < step_ms((10, 10), (3, 3))


def test_lengths_per_class_are_never_worse_and_equal_one_length_for_one_class():
    acc = tokens(0.55, 0.9, 0.3)
    for counts in [(1, 0, 0), (3, 2, 1), (60, 35, 25), (100, 60, 40)]:
        one, _ = best(counts, acc, 5, per_class=False)
        each, _ = best(counts, acc, 5, per_class=True)
        assert each >= one
    same = tokens(0.7, 0.7)
    assert best((20, 12), same, 5, per_class=True) == best((20, 12), same, 5, per_class=False)


def test_a_class_that_never_accepts_drafts_none_beside_one_that_does():
    rate, lengths = best((40, 40), tokens(0.95, 0.0), 5, per_class=True)
    assert lengths[0] > 0 and lengths[1] == 0
    assert rate > best((40, 40), tokens(0.95, 0.0), 5, per_class=False)[0]


def test_the_bound_reports_each_batch_and_gains_nothing_for_a_uniform_mix():
    uniform = (RequestClass("a", 0.5, 0.8), RequestClass("b", 0.5, 0.8))
    rows = bound(uniform, [1, 64], 5, draws=5, seed=0)
    assert [r["batch"] for r in rows] == [1, 64]
    assert all(r["per_class_over_one_length"] == 1.0 for r in rows)
    mixed = bound(parse_classes("copy:0.5:0.95,sampled:0.5:0.05"), [64], 5, draws=5, seed=0)
    assert mixed[0]["per_class_over_one_length"] > 1.0


def test_the_cli_writes_its_json_and_rejects_bad_arguments(tmp_path, capsys):
    out = tmp_path / "bound.json"
    assert main(["bound", "--batches", "1,32", "--draws", "3", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["batch"] for r in result["rows"]] == [1, 32] and result["meta"]["curve"] == "h200-8b-roofline"
    assert "per-class/one" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--batches"):
        main(["bound", "--batches", "0,4", "--out", ""])
    with pytest.raises(SystemExit, match="--ceiling"):
        main(["bound", "--ceiling", "0", "--out", ""])
