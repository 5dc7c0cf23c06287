"""tools/gpu_check.py's dry path on the CPU: the prepared GPU script's own code (the real training step,
tiny parity, the GEMM and FP8 timings, the 2-layer model's tokens/s, MFU and attention kernels) runs
end to end on tiny shapes, so the GPU run fails only on what needs a GPU; and the offline wheels'
installer installs only what does not import."""

from __future__ import annotations

import json

from tools import gpu_check, offline_deps


def test_the_dry_run_measures_every_section_and_passes(tmp_path):
    out = tmp_path / "gpu_check.json"
    code = gpu_check.main(["--device", "cpu", "--dry", "--skip-doctor", "--steps", "1", "--repeats", "1",
                           "--json", str(out)])
    report = json.loads(out.read_text())
    assert code == 0 and report["ok"], report
    assert report["tiny_parity"]["ok"] and report["tiny_parity"]["relative_diff"][0] == 0.0  # cpu against cpu
    gemm = report["gemm"]
    assert gemm["bf16_peak_tflops"] > 0 and set(gemm["fp8"]) == {"tensorwise", "rowwise", "mxfp8"}
    assert all("emulated" in r["path"] for r in gemm["fp8"].values())
    wide = report["wide_model"]
    assert wide["tokens_per_s"] > 0 and 0 < wide["mfu"] and len(wide["losses"]) == 3
    assert {k["kernel"] for k in wide["attention"].values()} == {"flash"}


def test_offline_install_takes_only_what_does_not_import(tmp_path, monkeypatch):
    import zipfile

    for name, top in (("omegaconf-2.4.0-py3-none-any.whl", "omegaconf/__init__.py"),
                      ("notinstalled_pkg-1.0-py3-none-any.whl", "notinstalled_pkg/__init__.py")):
        with zipfile.ZipFile(tmp_path / name, "w") as z:
            z.writestr(top, "")
            z.writestr(name.split("-")[0] + "-1.0.dist-info/METADATA", "")
    assert offline_deps.missing(tmp_path) == ["notinstalled_pkg"]
