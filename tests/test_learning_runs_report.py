"""The learning benchmark's figures of a run: what a table of runs says about the goal."""

import json
from pathlib import Path
from typing import Any

from tests.benchmark_modules import load_benchmark

learning_runs = load_benchmark("learning_runs")

KEY = "val/success"


def _run(curve: list[tuple[float, float]], max_steps: int | None = None) -> Any:  # a learning_runs.Run
    records = [{"step": 10 * i, "minutes": m, KEY: v} for i, (m, v) in enumerate(curve)]
    return learning_runs.Run(1, None, records, max_steps)


def test_a_dip_before_a_later_peak_shows_after_first_reaching_the_bar_not_after_the_peak() -> None:
    run = _run([(1, 0.0), (5, 0.76), (6, 0.36), (7, 0.70), (10, 0.83), (12, 0.81)])  # seed 3's shape
    assert run.peak(KEY) == (0.83, 10)
    assert run.low_after_peak(KEY) == 0.81
    assert run.low_after_reaching(KEY) == 0.36


def test_a_run_that_never_reached_the_bar_or_ended_on_it_has_no_low_after_it() -> None:
    assert _run([(1, 0.2), (5, 0.47), (9, 0.33)]).low_after_reaching(KEY) is None
    assert _run([(1, 0.2), (15, 0.61)]).low_after_reaching(KEY) is None
    assert _run([(1, 0.6), (2, 0.55)]).low_after_reaching(KEY) == 0.55  # the bar itself counts as reached


def test_the_table_and_the_csv_carry_the_low_after_reaching(tmp_path) -> None:
    runs = [_run([(1, 0.7), (2, 0.4), (3, 0.8)]), _run([(1, 0.1), (2, 0.65), (3, 0.6)])]
    rows = {row[0]: row[1] for row in learning_runs.summary_rows(runs, marks=(2,))}
    assert rows["lowest after first >= 0.6"] == "0.40 / 0.50 / 0.60"
    path = tmp_path / "runs.csv"
    learning_runs.write_csv(path, "FrozenLake", runs, marks=(2,))
    header, first, _ = path.read_text().splitlines()
    assert dict(zip(header.split(","), first.split(",")))["greedy_success_after_0.6_min"] == "0.4"


def test_the_figure_on_more_maps_is_the_last_checkpoint_played_by_each_mark(tmp_path) -> None:
    # rounds at steps 0, 10, ..., 50 at minutes 1, 4, 6, 9, 11, 16; checkpoints at steps 20 and 40 (6 and 11 min)
    run = _run([(1, 0.0), (4, 0.3), (6, 0.6), (9, 0.7), (11, 0.72), (16, 0.7)])
    run.checkpoint_success = {20: 0.55, 40: 0.66}
    assert [run.at_checkpoint(m) for m in (5, 10, 15, None)] == [None, 0.55, 0.66, 0.66]
    rows = {row[0]: row[1:] for row in learning_runs.summary_rows([run], marks=(10,), checkpoint_maps=1024)}
    assert rows["10 min, last checkpoint on 1024 maps"] == ["0.55 / 0.55 / 0.55", "-"]
    path = tmp_path / "runs.csv"
    learning_runs.write_csv(path, "FrozenLake", [run], marks=(10,), checkpoint_maps=1024)
    header, row = path.read_text().splitlines()
    figures = dict(zip(header.split(","), row.split(",")))
    assert (figures["greedy_success_10min_1024maps"], figures["greedy_success_end_1024maps"]) == ("0.55", "0.66")


def test_checkpoints_played_once_are_read_back_not_played_again(tmp_path) -> None:
    for step in (50, 100):
        (tmp_path / "checkpoints" / f"step_{step}").mkdir(parents=True)
    kept = {"maps": 1024, "val_maps": 64, "steps": {"50": {"on_val_maps": 0.72, "on_all_maps": 0.632},
                                                     "100": {"on_val_maps": 0.69, "on_all_maps": 0.681}}}
    (tmp_path / "checkpoint_maps_1024.json").write_text(json.dumps(kept))
    assert learning_runs.checkpoint_success(tmp_path, 1024) == {50: 0.632, 100: 0.681}


def test_a_run_stopped_before_a_mark_has_no_value_there_one_that_finished_keeps_its_last() -> None:
    curve = [(1, 0.1), (5, 0.4), (9, 0.5)]  # last record: step 20 at 9 minutes
    assert _run(curve, max_steps=400).at(KEY, 15) is None  # stopped (or cut off) at 9 minutes
    assert _run(curve, max_steps=20).at(KEY, 15) == 0.5  # ran all its steps by 9 minutes: that is its policy at 15
    assert _run(curve, max_steps=400).at(KEY, 5) == 0.4 and _run(curve, max_steps=400).at(KEY, None) == 0.5
    rows = {row[0]: row[1] for row in learning_runs.summary_rows([_run(curve, 400), _run([(14, 0.7), (16, 0.8)], 400)],
                                                                 marks=(15,))}
    assert rows["15 min"] == "0.70 / 0.70 / 0.70"  # the stopped run is left out, not counted at its last value


def test_a_seed_given_again_runs_in_its_own_dir() -> None:
    dirs = learning_runs.run_dirs(Path("out"), [42, 7, 42, 42])
    assert [d.name for d in dirs] == ["seed42", "seed7", "seed42-2", "seed42-3"]


def test_the_csv_carries_what_tells_a_format_wobble_from_a_large_update(tmp_path) -> None:
    records = [{"step": 1, "minutes": 1, "rollout/valid_action_rate": 0.99, "actor/approx_kl": 0.01},
               {"step": 2, "minutes": 2, "rollout/valid_action_rate": 0.5, "actor/approx_kl": 0.5},
               {"step": 2, "minutes": 2, KEY: 0.4, "val/valid_action_rate": 0.72},
               {"step": 3, "minutes": 3, "rollout/valid_action_rate": 0.98, "actor/approx_kl": 0.02}]
    run = learning_runs.Run(1, None, records)
    assert (run.extreme("valid_replies_min"), run.extreme("greedy_valid_min"), run.extreme("approx_kl_max")) \
        == (0.5, 0.72, 0.5)
    path = tmp_path / "runs.csv"
    learning_runs.write_csv(path, "FrozenLake", [run, _run([(1, 0.3)])], marks=(2,))
    header, first, second = path.read_text().splitlines()
    assert dict(zip(header.split(","), first.split(",")))["greedy_valid_min"] == "0.72"
    assert dict(zip(header.split(","), second.split(",")))["approx_kl_max"] == ""  # never logged: left empty


def test_a_reported_run_keeps_its_build_seconds_where_its_run_recorded_them(tmp_path) -> None:
    for name, build in (("seed1", {"build_s": 123.4}), ("seed2", None)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text('{"step": 0, "minutes": 0.1, "time": 1.0}\n')
        if build:
            (tmp_path / name / learning_runs.BUILD_RECORD).write_text(json.dumps(build))
    assert learning_runs.load_run(tmp_path / "seed1", 1).build_s == 123.4
    assert learning_runs.load_run(tmp_path / "seed2", 2).build_s is None


def test_the_record_reads_the_csv_and_counts_a_dip_or_a_late_peak_against_a_run(tmp_path: Path) -> None:
    learning_record = load_benchmark("learning_record")
    runs = [_run([(4, 0.65), (8, 0.45), (15, 0.7)]),  # fell under 0.5 after reaching 0.6
            _run([(4, 0.3), (9, 0.62), (12, 0.58), (15, 0.72)]),  # met: reached, no round under 0.5 after
            _run([(5, 0.3), (15.5, 0.8)])]  # reached 0.6 only after the 15-minute mark
    learning_runs.write_csv(tmp_path / "learning_runs-frozen_lake_t.csv", "FrozenLake", runs)
    record = learning_record.read_runs("t", tmp_path)
    assert [r.met for r in record] == [False, True, False]
    assert [r.at_15 for r in record] == [0.7, 0.72, 0.3]
    assert [r.at_15_on_many_maps for r in record] == [None, None, None]  # no checkpoints played on more maps
    runs[1].checkpoint_success = {20: 0.61}  # its round at step 20 came at 12 minutes
    learning_runs.write_csv(tmp_path / "learning_runs-frozen_lake_m.csv", "FrozenLake", runs, checkpoint_maps=1024)
    assert [r.at_15_on_many_maps for r in learning_record.read_runs("m", tmp_path)] == [None, 0.61, None]
    assert not learning_record.whole_goal(record)
    held = [learning_record.RecordRun(42, at, at, True, None) for at in (0.65, 0.7, 0.8)]
    assert learning_record.whole_goal(held) and not learning_record.whole_goal(held[:2])
    low_median = [learning_record.RecordRun(42, at, at, True, None) for at in (0.65, 0.69, 0.8)]
    assert not learning_record.whole_goal(low_median)


def test_a_run_on_more_maps_reads_on_its_first_ones_greedy_only() -> None:
    records = [{"step": 0, "minutes": 1, KEY: 0.5, "val_first64/success": 0.7, "val_sampled/success": 0.4},
               {"step": 5, "minutes": 2, "rollout/success": 0.3}]
    run = learning_runs.Run(1, None, records).on_first_maps(64)
    assert run.curve(KEY) == [(1, 0.7)]
    assert run.curve("val_sampled/success") == []  # logged over all the maps: not part of this view
    assert run.curve("rollout/success") == [(2, 0.3)]
