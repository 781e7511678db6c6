"""What a Ray task and the driver send each other (``splitleak.experiments.shipping``): a run directory
arrives whole and verified or is refused, and a job's result lands in the driver's store once."""

from __future__ import annotations

import shutil

import pytest

from splitleak.errors import IntegrityError
from splitleak.experiments.shipping import deliver, outputs_parcel, run_parcel, unpack_run
from splitleak.experiments.store import ResultsStore
from splitleak.files import sha256_bytes
from splitleak.runs.verify import verify_run

pytestmark = pytest.mark.integration

KEY = "ab" * 32  # a train job's key (only its name matters here)
ATTACK = {"kind": "attack", "key": "cd" * 32, "train_key": KEY}


@pytest.fixture
def store(tmp_path, shared_run):
    """A store holding one finished train job: its run directory and its row file."""
    run = shared_run(model="tiny-gpt2", depth=2, n_calib=4, n_train=6, n_eval=12, seed=0, all_local_baseline=False)
    rs = ResultsStore(tmp_path / "driver")
    shutil.copytree(run, rs.run_dir(KEY))
    rs.write_rows("train", KEY, [{"key": KEY, "kind": "train"}])
    return rs


def _files(store: ResultsStore) -> dict[str, bytes]:
    return {p.relative_to(store.root).as_posix(): p.read_bytes() for p in store.root.rglob("*") if p.is_file()}


def test_a_run_arrives_whole_and_verified(store, tmp_path):
    node = ResultsStore(tmp_path / "node")
    unpack_run(run_parcel(store, KEY), node, KEY)
    assert _files(node) == _files(store)
    assert verify_run(node.run_dir(KEY)).status == "complete" and node.is_done({"kind": "train", "key": KEY})


def test_a_run_changed_on_the_way_is_refused(store, tmp_path):
    p = run_parcel(store, KEY)
    rel = next(r for r in p["files"] if r.endswith("manifest.json"))
    p["files"][rel] = p["files"][rel] + b" "
    with pytest.raises(IntegrityError, match="another sha256 than it was sent with"):
        unpack_run(p, ResultsStore(tmp_path / "a"), KEY)
    p["sha256"][rel] = sha256_bytes(p["files"][rel])  # changed before it was sent: the journal notices
    with pytest.raises(IntegrityError, match="does not verify"):
        unpack_run(p, ResultsStore(tmp_path / "b"), KEY)
    p = run_parcel(store, KEY)
    for name in ("attacks/x.parquet", f"runs/{KEY[:16]}/../x"):  # names out of the run are not written
        p["files"][name], p["sha256"][name] = b"x", sha256_bytes(b"x")
        with pytest.raises(IntegrityError, match="not a file of run"):
            unpack_run(p, ResultsStore(tmp_path / "c"), KEY)
        del p["files"][name], p["sha256"][name]
    assert not (tmp_path / "x").exists() and not (tmp_path / "c" / "runs" / "x").exists()


def test_a_train_result_lands_whole_and_once(store, tmp_path):
    driver = ResultsStore(tmp_path / "d")
    job = {"kind": "train", "key": KEY}
    p = outputs_parcel(store, job)
    deliver(driver, job, p)
    assert _files(driver) == _files(store)
    assert not list(driver.root.rglob(".*.tmp"))
    again = outputs_parcel(store, job)
    rel = next(r for r in again["files"] if r.endswith("journal.jsonl"))
    again["files"][rel] += b"{}\n"
    again["sha256"][rel] = sha256_bytes(again["files"][rel])
    deliver(driver, job, again)  # a job already done keeps its first result
    assert _files(driver) == _files(store)


def test_a_damaged_train_result_leaves_the_job_undone(store, tmp_path):
    driver = ResultsStore(tmp_path / "d")
    job = {"kind": "train", "key": KEY}
    p = outputs_parcel(store, job)
    rel = next(r for r in p["files"] if r.endswith("manifest.json"))
    del p["files"][rel], p["sha256"][rel]
    with pytest.raises(IntegrityError, match="does not verify"):
        deliver(driver, job, p)
    assert not driver.is_done(job) and not driver.run_dir(KEY).exists()
    assert not list((driver.root / "runs").iterdir())  # no temporary folder left


def test_an_attack_result_is_its_row_file_only(store, tmp_path):
    store.write_rows("attack", ATTACK["key"], [{"key": ATTACK["key"], "kind": "attack"}])
    driver = ResultsStore(tmp_path / "d")
    p = outputs_parcel(store, ATTACK)
    assert list(p["files"]) == [f"attacks/{ATTACK['key']}.parquet"]
    p["files"]["train/x.parquet"], p["sha256"]["train/x.parquet"] = b"x", sha256_bytes(b"x")
    with pytest.raises(IntegrityError, match="files other than its row file"):
        deliver(driver, ATTACK, p)
    assert not driver.is_done(ATTACK)
    deliver(driver, ATTACK, outputs_parcel(store, ATTACK))
    assert driver.read_job("attack", ATTACK["key"]).num_rows == 1
