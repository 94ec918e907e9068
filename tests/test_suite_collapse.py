"""The stability grid's collapse table (experiments/suite_collapse.py) on hand-made runs."""

from __future__ import annotations

import pytest

from experiments.suite_collapse import cell_of, collapse_table


def run(arm, seed, final, start=0.4, drift="answer_format"):
    return {"arm": arm, "seed": seed, "drift": drift, "final_reward": final, "start_success": start}


def test_a_cell_collapses_by_each_measure_when_two_of_its_three_seeds_do():
    frozen = [run("frozen", s, f) for s, f in enumerate([0.30, 0.10, 0.30])]
    # finals 0.15, 0.25, 0.10 against half the start (0.2): seeds 0 and 2 collapse; against half the frozen final
    # (0.15, 0.05, 0.15): seed 2 alone (0.15 is not below 0.15)
    cell = [run("sao@eta64-u4-lrx2", s, f) for s, f in enumerate([0.15, 0.25, 0.10])]
    steady = [run("sao@eta4-u1-lrx1", s, 0.6) for s in range(3)]
    rows = {r["eta"]: r for r in collapse_table(frozen + cell + steady)}
    assert rows[64] == {"arm": "sao", "eta": 64, "updates": 4, "lr_factor": 2.0, "seeds": 3,
                        "final": pytest.approx(0.5 / 3), "start": pytest.approx(0.4),
                        "frozen_final": pytest.approx(0.7 / 3), "collapsed_vs_start": 2, "collapsed_vs_frozen": 1,
                        "cell_collapsed_vs_start": True, "cell_collapsed_vs_frozen": False}
    assert not rows[4]["cell_collapsed_vs_start"] and rows[4]["collapsed_vs_frozen"] == 0


def test_a_cell_without_the_frozen_run_of_its_seed_or_a_name_outside_the_grid_is_refused():
    with pytest.raises(ValueError, match="no frozen run at"):
        collapse_table([run("frozen", 0, 0.3), run("sao@eta0-u1-lrx1", 1, 0.3)])
    with pytest.raises(ValueError, match="not a stability cell"):
        cell_of("sao")


def test_the_grid_figure_lays_its_update_and_lr_panels_in_two_rows(tmp_path):
    from PIL import Image

    from experiments.suite_collapse import plot

    frozen = [run("frozen", s, 0.3) for s in range(3)]
    cells = [run(f"{a}@eta{e}-u{u}-lrx1", s, 0.5) for a in ("sao", "ppo") for e in (0, 4) for u in (1, 2, 4)
             for s in range(3)]
    # 3 (updates, lr) panels in 2 rows: 2 columns of 4 x 7 inches at 110 dpi
    with Image.open(plot(collapse_table(frozen + cells), tmp_path / "grid.png")) as img:
        assert img.size == (880, 770)
