"""The tuned kernel choices (kernels/tuned_configs.json, kernels/tuned.py): the values the kernels shipped with as
module constants, the per-device merge, and a benchmark's override file."""

from __future__ import annotations

import json

import torch

from lazyrag.kernels import tuned


def test_default_values_are_the_measured_ones():
    t = tuned.for_device_name("default")
    assert t is tuned.tuned(torch.device("cpu"))
    assert (t["prefill"]["kernel"], t["prefill"]["config"], t["prefill"]["rotation_mode"]) == (
        "wgmma",
        [128, 128, 8, 3],
        5,
    )
    assert (t["prefill"]["short_config"], t["prefill"]["short_rotation_mode"]) == ([64, 64, 4, 3], 7)
    assert t["prefill_wgmma"] == {"config": [128, 64, 12, 6], "registers": [216, 72], "key_chunk": 16}
    d = t["decode"]
    assert (d["config"], d["rotation_mode"], d["small_grid_programs"]) == ([64, 4, 3, 128], 5, 16)
    assert (d["small_grid_config"], d["small_grid_rotation_mode"]) == ([32, 4, 3, None], 2)
    assert t["merge"] == {"rows": 1, "warps": 2}
    assert t["gemv"]["config"] == [8, 512, 4, 1] and t["gemv"]["shapes"]["4096,14336,3"] == [8, 512, 4, 3]
    assert t["gemm"]["config"] == [64, 128, 4, 4, 1] and t["gemm"]["shapes"] == {}


def test_device_entry_and_override_merge_key_by_key():
    base = {"prefill": {"config": [1, 2, 3, 4], "rotation_mode": 5}, "merge": {"rows": 1, "warps": 2}}
    got = tuned.merged(base, {"prefill": {"rotation_mode": 7}})
    assert got == {"prefill": {"config": [1, 2, 3, 4], "rotation_mode": 7}, "merge": {"rows": 1, "warps": 2}}
    assert base["prefill"]["rotation_mode"] == 5  # not modified
    t = tuned.tuned(torch.device("cpu"), {"decode": {"rotation_mode": 2}})
    assert t["decode"]["rotation_mode"] == 2 and t["decode"]["config"] == [64, 4, 3, 128]


def test_override_files_from_the_environment(tmp_path, monkeypatch):
    extra = tmp_path / "adopted.json"
    extra.write_text(json.dumps({"Some GPU": {"gemv": {"shapes": {"1,2,0": [1, 64, 4, 1]}}}}))
    monkeypatch.setenv("LAZYRAG_TUNED_CONFIGS", str(extra))
    tuned._table.cache_clear()
    tuned.for_device_name.cache_clear()
    try:
        t = tuned.for_device_name("Some GPU")
        assert t["gemv"]["shapes"]["1,2,0"] == [1, 64, 4, 1] and "4096,4096,0" in t["gemv"]["shapes"]
        assert "1,2,0" not in tuned.for_device_name("default")["gemv"]["shapes"]
    finally:
        monkeypatch.delenv("LAZYRAG_TUNED_CONFIGS")
        tuned._table.cache_clear()
        tuned.for_device_name.cache_clear()


def test_the_wheel_ships_the_table():
    from pathlib import Path

    import tomllib

    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert "tuned_configs.json" in pyproject["tool"]["setuptools"]["package-data"]["lazyrag.kernels"]
