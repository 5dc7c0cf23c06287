"""bench/fp8.py's `measure_gemm_tflops`, the function tools/gpu_check.py calls: its rows' contract, on tiny CPU shapes (no timing is asserted)."""

from __future__ import annotations

from bench.fp8 import measure_gemm_tflops


def test_rows_name_gemm_recipe_timing_path_and_ratio():
    rows = measure_gemm_tflops("cpu", tokens=48, hidden=64, out_features=96, experts=3, rounds=1, warmup=0)
    keys = {"gemm", "recipe", "timing", "path", "kernel", "ms", "tflops", "x_bf16", "skipped"}
    assert all(set(r) == keys for r in rows)
    got = [(r["gemm"], r["recipe"], r["timing"]) for r in rows]
    assert got[:2] == [("dense", "bf16", "as trained"), ("grouped", "bf16", "as trained")]
    for recipe in ("tensorwise", "rowwise", "mxfp8"):  # every recipe emulated on the CPU: nothing skipped
        assert [(g, t) for g, r, t in got if r == recipe] == [("dense", "as trained"), ("dense", "kernel"),
                                                                ("grouped", "as trained")]
    assert all(r["path"] == "emulated" for r in rows if r["recipe"] != "bf16")
    assert all(r["ms"] > 0 and r["tflops"] > 0 and r["x_bf16"] > 0 for r in rows)
    assert [r["kernel"] for r in rows if r["gemm"] == "grouped" and r["recipe"] == "rowwise"] == ["scaled_mm per expert"]
