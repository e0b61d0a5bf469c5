"""The agreed judgements as data: preference pairs and unpaired labels that DPO, KTO and
reward-model training read directly, with the filter's counts and the agreement beside them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from alignzoo.config.schema import DataConfig
from alignzoo.engine.datasets import load_split
from alignzoo.human.export import SUMMARY_FILE, export
from alignzoo.human.queue import HumanQueue
from alignzoo.types import LabelRequest

# (prompt, response) -> the two annotators' ratings on 1..5
RATINGS = {
    ("0+1=", "1"): (5, 5),  # agreed: 1.0
    ("0+1=", "7"): (1, 1),  # agreed: 0.0 -> "1" is preferred to "7"
    ("1+1=", "2"): (5, 1),  # disagreement: filtered out
    ("2+1=", "3"): (1, 2),  # agreed: 0.125
}
# (prompt, a, b) -> the two annotators' choices (1: A better, 0: B better, 0.5: tie)
PAIRS = {
    ("2+2=", "4", "5"): (1, 1),  # agreed: A
    ("3+3=", "6", "7"): (1, 0),  # disagreement
    ("1+2=", "3", "3."): (0.5, 0.5),  # an agreed tie: no preference
}


@pytest.fixture
def queue_dir(tmp_path: Path) -> Path:
    queue = HumanQueue(tmp_path / "q")
    ids = queue.enqueue([LabelRequest(prompt=p, response=r) for p, r in RATINGS], 2, (1, 5))
    pair_ids = queue.enqueue_pairs(list(PAIRS), raters=2)
    judged = [*zip(ids, RATINGS.values(), strict=True), *zip(pair_ids, PAIRS.values(), strict=True)]
    for item, values in judged:
        for rater, value in zip(("ann", "bob"), values, strict=True):
            queue.submit(item, rater, value)
    queue.close()
    return tmp_path / "q"


def _read(folder: Path, kind: str) -> list[dict]:
    data = load_split(DataConfig(train=str(folder), eval=str(folder)), "train", kind)
    return data.to_list()


def test_preference_export_holds_only_agreed_pairs(queue_dir, tmp_path) -> None:
    summary = export(queue_dir, tmp_path / "prefs", "preference")
    rows = _read(tmp_path / "prefs", "preference")
    assert {(r["prompt"], r["chosen"], r["rejected"]) for r in rows} == {
        ("2+2=", "4", "5"),
        ("0+1=", "1", "7"),
    }
    assert all(r["agreeing"] == 2 and r["judged"] == 2 for r in rows)
    assert (summary.ratings.kept, summary.ratings.disagreed, summary.ratings.too_few) == (3, 1, 0)
    assert (summary.pairs.kept, summary.pairs.disagreed, summary.ties) == (2, 1, 1)
    written = json.loads((tmp_path / "prefs" / SUMMARY_FILE).read_text())
    assert written["rows"] == 2 and written["agreement"]["pairs"]["raw_agreement"] == pytest.approx(
        2 / 3
    )
    assert written["agreement"]["ratings"]["krippendorff_alpha"] is not None


def test_unpaired_export_labels_ratings_and_both_sides_of_a_pair(queue_dir, tmp_path) -> None:
    export(queue_dir, tmp_path / "labels", "unpaired", threshold=0.5)
    rows = _read(tmp_path / "labels", "unpaired")
    assert {(r["prompt"], r["completion"], r["label"]) for r in rows} == {
        ("0+1=", "1", True),
        ("0+1=", "7", False),
        ("2+1=", "3", False),
        ("2+2=", "4", True),
        ("2+2=", "5", False),
    }


def test_the_cli_exports_and_serves_by_default(queue_dir, tmp_path) -> None:
    cli = [sys.executable, "-m", "alignzoo", "annotate"]
    done = subprocess.run(
        [*cli, "export", str(queue_dir), str(tmp_path / "out"), "--as", "preference"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert "2 preference rows" in done.stdout and "1 ties left out" in done.stdout
    again = subprocess.run(
        [*cli, "export", str(queue_dir), str(tmp_path / "out")], capture_output=True, text=True
    )
    assert again.returncode == 2 and "exists; choose a new folder" in again.stderr
    zero = subprocess.run(
        [*cli, "export", str(queue_dir), str(tmp_path / "z"), "--tolerance", "0"],
        capture_output=True,
        text=True,
    )
    assert zero.returncode == 2 and "tolerance" in zero.stderr and not (tmp_path / "z").exists()
    # `alignzoo annotate QUEUE_DIR` is the serve command: a folder without a queue is refused.
    missing = subprocess.run([*cli, str(tmp_path / "nothing")], capture_output=True, text=True)
    assert missing.returncode == 2 and "no queue here" in missing.stderr
    assert not (tmp_path / "nothing").exists()
