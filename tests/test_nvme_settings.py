"""The NVMe tier's settings refused at start by name (engram/rowstore/nvme_checks.py), before
any page file: the cases an outside battery met as silent creation on the wrong disk, a bare
FileExistsError, a bare BlockingIOError and a host-table message that never named the cache."""

from __future__ import annotations

import os

import pytest
from launcher import run_isolated
from small_job import small_job

from engram.config import config_from_dict
from engram.rowstore.nvme_checks import NvmeSettingError, check_nvme_settings

GIB = 2**30


def _check(dirs, create=False, cache_gib=1.0, ranks=1, available=64 * GIB):
    return check_nvme_settings([str(d) for d in dirs], create, cache_gib, ranks, available)


def test_a_missing_directory_is_refused_unless_created_inside_its_existing_parent(tmp_path):
    missing = tmp_path / "nvme0" / "engram"
    with pytest.raises(
        NvmeSettingError, match=r"'.*nvme0/engram' does not exist.*nvme_create_dirs"
    ):
        _check([missing])
    assert not (tmp_path / "nvme0").exists()  # nothing created
    with pytest.raises(NvmeSettingError, match=r"neither does its parent .*nvme0.*unmounted"):
        _check([missing], create=True)
    assert not (tmp_path / "nvme0").exists()
    (tmp_path / "nvme0").mkdir()  # the drive's mount point
    assert _check([missing], create=True) == [str(missing)]
    assert missing.is_dir()
    assert _check([missing], create=True) == [str(missing)]  # exists now: nothing to do


def test_a_file_is_refused(tmp_path):
    (tmp_path / "oops").write_text("")
    with pytest.raises(NvmeSettingError, match=r"'.*oops' is a file, not a directory"):
        _check([tmp_path / "oops"], create=True)


@pytest.mark.parametrize("spelling", ["{d}/", "{d}/../{name}", "{d}/.", "link"])
def test_the_same_directory_twice_is_refused_under_any_spelling(tmp_path, spelling):
    d = tmp_path / "a"
    d.mkdir()
    (tmp_path / "link").symlink_to(d)
    other = str(tmp_path / "link") if spelling == "link" else spelling.format(d=d, name="a")
    with pytest.raises(NvmeSettingError, match=r"the same directory twice.*list each drive"):
        check_nvme_settings([str(d), other], False, 1.0, 1, 64 * GIB)
    (tmp_path / "b").mkdir()
    assert _check([d, tmp_path / "b"]) == [str(d), str(tmp_path / "b")]


def test_an_unwritable_directory_is_refused(tmp_path):
    if os.geteuid() == 0:  # root writes through permission bits: sysfs refuses root too
        target = "/sys"
    else:
        target = tmp_path / "ro"
        target.mkdir(mode=0o500)
    with pytest.raises(NvmeSettingError, match=r"is not writable by this process \(Permission"):
        _check([target])


def test_a_host_cache_above_host_memory_names_the_setting_and_its_fix(tmp_path):
    with pytest.raises(NvmeSettingError) as e:
        _check([tmp_path], cache_gib=100000, ranks=8, available=512 * GIB)
    msg = str(e.value)
    assert "engram.nvme_host_cache_gib = 100000 GiB per rank x 8 rank(s)" in msg, msg
    assert "512.0 GiB are available" in msg and "lower engram.nvme_host_cache_gib below 64.0" in msg
    assert "host_memory_gib" not in msg and "rowwise_adagrad" not in msg  # not the host tables'
    _check([tmp_path], cache_gib=8, ranks=8, available=512 * GIB)  # 64 GiB: fits


def _train_raises(raw: dict) -> str:
    from recipes.train import train

    try:
        train(config_from_dict(raw))
    except NvmeSettingError as e:
        return str(e)
    return "trained"


@pytest.mark.slow
def test_the_recipe_refuses_at_start_before_any_page_file(tmp_path):
    """Through recipes/train.py: a mistyped drive is refused before the model is materialised
    (no directory, no page file anywhere under the run's folder)."""
    typo = tmp_path / "mnt" / "nvme0" / "engarm"
    raw = small_job(str(tmp_path / "run"), "nvme", 1, 2, {
        "engram": {"table_location": "nvme", "nvme_dirs": [str(typo)]},
        "optimizer": {"table_optimizer": "lazy_adam"},
    })  # fmt: skip
    msg = run_isolated(_train_raises, raw)
    assert "engram.nvme_dirs entry" in msg and "does not exist" in msg, msg
    assert not (tmp_path / "mnt").exists()
    assert not list(tmp_path.rglob("*.pages"))
