"""``python -m deepep_cupy.jit precompile``: fills the cache, verifies it on a second run, repairs an altered
entry; the worker pool, failures, and the command line. No GPU needed (the layout family compiles in a
few seconds; the other families are only listed)."""

from __future__ import annotations

import hashlib
import importlib
import io
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from deepep_cupy.jit import BuildSpec
from deepep_cupy.jit import precompile as pre
from deepep_cupy.jit.__main__ import main as jit_main

REPO = Path(__file__).resolve().parents[2]
SUMMARY_RE = re.compile(r"precompile: (\d+) compiled(?: \((\d+) repaired\))?, (\d+) verified from the cache, "
                        r"(\d+) failed")


def _precompile(cache: Path, *args: str) -> tuple[tuple[int, int, int, int], str]:
    env = {**os.environ, "DEEPEP_CUPY_CACHE_DIR": str(cache), "PYTHONPATH": str(REPO)}
    env.pop("DEEPEP_CUPY_SOURCE_DIR", None)
    proc = subprocess.run([sys.executable, "-m", "deepep_cupy.jit", "precompile", *args], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    match = SUMMARY_RE.search(proc.stdout)
    assert match, proc.stdout
    compiled, repaired, verified, failed = (int(g or 0) for g in match.groups())
    return (compiled, repaired, verified, failed), proc.stdout


def test_precompile_fills_verifies_and_repairs(tmp_path):
    from deepep_cupy.ops import layout

    count = len(layout.representative_builds())
    cache = tmp_path / "cache"
    counts, out = _precompile(cache, "--arch", "sm_90", "-j", "2", "layout")
    assert counts == (count, 0, 0, 0)
    assert f"[{count}/{count}] compiled layout: layout/" in out
    entries = sorted(cache.glob("??/*/kernel.cubin"))
    assert len(entries) == count

    counts, out = _precompile(cache, "layout", "--arch", "90")
    assert counts == (0, 0, count, 0)
    assert out.count("verified layout:") == count

    victim = random.choice(entries)
    data = bytearray(victim.read_bytes())
    start = random.randrange(64, len(data) - 64)
    data[start:start + 64] = bytes(b ^ 0xA5 for b in data[start:start + 64])  # same size, other bytes
    victim.write_bytes(bytes(data))
    counts, out = _precompile(cache, "--arch=sm_90", "layout")
    assert counts == (1, 1, count - 1, 0)
    assert "repaired layout:" in out and "SHA-256" in out
    meta = json.loads((victim.parent / "meta.json").read_text())
    assert hashlib.sha256(victim.read_bytes()).hexdigest() == meta["cubin_sha256"]


KERNEL = "template <int k> __global__ void twice(int* out) { out[threadIdx.x] = (int)threadIdx.x * k * BASE; }\n"


def test_pool_builds_and_reports_failures(tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    (src / "k.cu").write_text(KERNEL)
    (src / "bad.cu").write_text("__global__ void bad(int* out) { out[0] = undeclared; }\n")
    monkeypatch.setenv("DEEPEP_CUPY_SOURCE_DIR", str(src))  # the workers inherit the environment
    monkeypatch.setenv("DEEPEP_CUPY_CACHE_DIR", str(tmp_path / "cache"))
    scales = random.sample(range(2, 60), 3)
    good = [pre.Job("tiny", BuildSpec.make("k.cu", {"BASE": 5}, [f"twice<{s}>"]), "sm_90") for s in scales]
    bad = pre.Job("tiny", BuildSpec.make("bad.cu"), "sm_80")
    out = io.StringIO()
    report = pre.run([*good, bad], workers=2, out=out)
    assert (report.compiled, report.repaired, report.verified) == (3, 0, 0)
    assert len(report.failed) == 1 and "bad.cu" in report.failed[0] and "undeclared" in report.failed[0]
    lines = out.getvalue().splitlines()
    assert len(lines) == 4 and {line.split()[0] for line in lines} == {"[1/4]", "[2/4]", "[3/4]", "[4/4]"}

    again = pre.run(good, workers=2, out=io.StringIO())  # verified in this process: no pool needed
    assert (again.compiled, again.verified, again.failed) == (0, 3, [])


def test_families_name_modules_with_representative_builds():
    for family, module_name in pre.FAMILIES.items():
        module = importlib.import_module(module_name)
        specs = pre.family_specs(family)
        assert specs and all(isinstance(s, BuildSpec) for s in specs), family
        assert callable(module.representative_builds)
    with pytest.raises(ValueError, match="unknown kernel family"):
        pre.family_specs("nope")


def test_plan_lists_each_kernel_once_per_arch():
    jobs = pre.plan(["layout", "layout"], ["sm_90", "sm_80"])
    specs = pre.family_specs("layout")
    assert len(jobs) == 2 * len(specs)
    assert {(j.spec, j.arch) for j in jobs} == {(s, a) for s in specs for a in ("sm_90", "sm_80")}


def test_default_arch(monkeypatch):
    monkeypatch.setattr(pre, "first_device_arch", lambda: None)
    assert pre.default_arch() == "sm_90" and pre._archs(None) == ["sm_90"]
    monkeypatch.setattr(pre, "first_device_arch", lambda: "sm_100")
    assert pre._archs(None) == ["sm_100"]
    assert pre._archs(["sm_80,90", "8.0", "sm_90a"]) == ["sm_80", "sm_90", "sm_90a"]


@pytest.mark.parametrize("argv", [["nope"], ["--arch", "hopper", "layout"], ["--jobs", "0", "layout"]])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as info:
        pre.main(argv)
    assert info.value.code == 2
    assert "error" in capsys.readouterr().err


def test_module_entry_point(capsys):
    assert jit_main(["--help"]) == 0 and "precompile" in capsys.readouterr().out
    assert jit_main([]) == 2
    assert jit_main(["compile-all"]) == 2 and "unknown command" in capsys.readouterr().err


def test_family_module_that_moved_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(pre.FAMILIES, "layout", "deepep_cupy.ops.no_such_module")
    assert pre.main(["--arch", "sm_90", "layout"]) == 2
    assert "no_such_module" in capsys.readouterr().err
