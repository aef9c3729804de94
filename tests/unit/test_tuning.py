"""Tuned configs without a GPU: the store written by ``python -m deepep_cupy.tuning``, what
``Buffer.get_dispatch_config`` / ``get_combine_config`` read from it, and the tuner's command line."""

import io
import json
import os
import subprocess
import sys
import time

import pytest

from deepep_cupy import Buffer, Config, tuning
from deepep_cupy.tuning import cli as tune

GPU = "NVIDIA H200"


@pytest.fixture
def store(tmp_path, monkeypatch):
    """An empty cache directory of its own, this process's GPU model faked, Buffer's SM count restored after."""
    monkeypatch.setenv("DEEPEP_CUPY_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tuning, "gpu_model", lambda: GPU)
    saved = Buffer.num_sms, Buffer._num_sms_set
    Buffer.num_sms, Buffer._num_sms_set = 20, False  # as in a new process (other tests call set_num_sms)
    tuning.forget()
    yield tmp_path / tuning.STORE_NAME
    tuning.forget()
    Buffer.num_sms, Buffer._num_sms_set = saved


def _save(gpu=GPU, num_ranks=8, hidden=7168, num_sms=24, created=None):
    by_sms = {sms: {"dispatch": Config(sms, send, 512, 6, 128), "combine": Config(sms, send + 1, 256, 6, 128),
                    "dispatch_us": 100.0, "combine_us": 120.0}
              for sms, send in ((20, 2), (24, 4), (32, 8))}
    entry = tuning.make_entry(gpu, num_ranks, hidden, num_sms, by_sms, workload={"tokens": 4096})
    if created is not None:
        entry["created"] = created
    return tuning.save_entry(entry)


def _builtin(op, num_ranks, num_sms=20):
    return Config(num_sms, *_fields(tune.builtin_configs(num_ranks)[op])[1:])


def _fields(cfg):
    return (cfg.num_sms, cfg.num_max_nvl_chunked_send_tokens, cfg.num_max_nvl_chunked_recv_tokens,
            cfg.num_max_rdma_chunked_send_tokens, cfg.num_max_rdma_chunked_recv_tokens)


def test_without_a_store_the_builtin_configs_and_no_gpu_lookup(store, monkeypatch):
    def no_gpu_lookup():
        raise AssertionError("the GPU model is looked up although no tuned configs are stored")

    monkeypatch.setattr(tuning, "gpu_model", no_gpu_lookup)
    assert not store.exists()
    assert Buffer.get_dispatch_config(8) == _builtin("dispatch", 8)
    assert Buffer.get_combine_config(8, hidden=7168) == _builtin("combine", 8)


def test_stored_configs_are_returned(store):
    path = _save()
    assert path == store and store.exists()
    assert Buffer.get_dispatch_config(8) == Config(24, 4, 512, 6, 128)
    assert Buffer.get_combine_config(8) == Config(24, 5, 256, 6, 128)
    assert Buffer.get_dispatch_config(8, hidden=7168) == Config(24, 4, 512, 6, 128)
    # Other hidden sizes and rank counts were not tuned: the built-in recommendations.
    assert Buffer.get_dispatch_config(8, hidden=4096) == _builtin("dispatch", 8)
    assert Buffer.get_dispatch_config(4) == _builtin("dispatch", 4)


def test_entries_of_another_gpu_model_are_ignored(store):
    _save(gpu="NVIDIA H100 80GB HBM3")
    assert Buffer.get_dispatch_config(8) == _builtin("dispatch", 8)


def test_without_hidden_the_hidden_size_tuned_last(store):
    _save(hidden=4096, num_sms=20, created=time.time() - 100)
    _save(hidden=7168, num_sms=32, created=time.time())
    assert Buffer.get_dispatch_config(8) == Config(32, 8, 512, 6, 128)
    assert Buffer.get_dispatch_config(8, hidden=4096) == Config(20, 2, 512, 6, 128)
    assert len(tuning.read_entries()) == 2


def test_set_num_sms_keeps_its_sm_count(store):
    _save()
    Buffer.set_num_sms(32)
    assert Buffer.get_dispatch_config(8) == Config(32, 8, 512, 6, 128)
    Buffer.set_num_sms(28)  # not tuned: the built-in chunk sizes with 28 SMs
    assert Buffer.get_combine_config(8) == _builtin("combine", 8, num_sms=28)


def test_lookups_are_remembered_and_return_fresh_configs(store, monkeypatch):
    _save()
    first = Buffer.get_dispatch_config(8)
    first.num_sms = 2  # the caller's copy
    reads = []
    monkeypatch.setattr(tuning, "read_entries", lambda *a: reads.append(a) or {})
    store.unlink()
    assert Buffer.get_dispatch_config(8) == Config(24, 4, 512, 6, 128)
    assert reads == []
    tuning.forget()  # a new process, or one that wants to see the file again
    assert Buffer.get_dispatch_config(8) == _builtin("dispatch", 8)


def test_a_damaged_store_is_named_and_ignored(store):
    store.write_text("{not json")
    with pytest.warns(UserWarning, match="ignoring the tuned configs"):
        assert Buffer.get_dispatch_config(8) == _builtin("dispatch", 8)
    _save()  # the tuner replaces it
    assert Buffer.get_dispatch_config(8) == Config(24, 4, 512, 6, 128)


def test_a_store_of_another_format_is_ignored(store):
    store.write_text(json.dumps({"format": 999, "entries": {}}))
    with pytest.warns(UserWarning, match="another version"):
        assert Buffer.get_dispatch_config(8) == _builtin("dispatch", 8)


def test_invalid_stored_configs_are_skipped(store):
    _save()
    data = json.loads(store.read_text())
    (entry,) = data["entries"].values()
    entry["by_sms"]["24"]["dispatch"] = [24, 600, 512, 6, 128]  # send chunk above the ring capacity
    store.write_text(json.dumps(data))
    tuning.forget()
    assert Buffer.get_dispatch_config(8) == _builtin("dispatch", 8)
    assert Buffer.get_combine_config(8) == Config(24, 5, 256, 6, 128)


def test_bad_hidden_is_a_value_error(store):
    _save()
    with pytest.raises(ValueError, match="hidden"):
        Buffer.get_dispatch_config(8, hidden=0)


def test_the_buffer_default_config_is_the_tuned_one(store):
    pytest.importorskip("mpi4py")
    from mpi4py import MPI

    _save(num_ranks=1)
    buffer = Buffer(comm=MPI.COMM_SELF, backend="reference", explicitly_destroy=True)
    try:
        from deepep_cupy import buffer as B

        assert buffer._default_config(B._DISPATCH_CONFIGS) == Config(24, 4, 512, 6, 128)
        assert buffer._default_config(B._COMBINE_CONFIGS) == Config(24, 5, 256, 6, 128)
    finally:
        buffer.destroy()


def test_the_store_lives_in_the_kernel_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPEP_CUPY_CACHE_DIR", str(tmp_path / "cache"))
    assert tuning.store_path() == tmp_path / "cache" / "tuned_configs.json"


def test_make_entry_needs_the_chosen_sm_count():
    with pytest.raises(ValueError, match="not among"):
        tuning.make_entry(GPU, 8, 7168, 16, {24: {"dispatch": Config(24), "combine": Config(24)}})


# ---------------------------------------------------------------- the tuner's sweep and command line
def test_plan_points_include_the_builtin_configs():
    builtin = {"dispatch": Config(20, 6, 256), "combine": Config(20, 1, 256)}
    plan = tune.plan_points((24, 32), (1, 4, 300), (256, 512), builtin)
    assert set(plan) == {24, 32, 20}
    assert plan[20] == [("dispatch", 6, 256), ("combine", 1, 256)]
    assert ("dispatch", 300, 512) in plan[24] and ("dispatch", 300, 256) not in plan[24]
    # the combine's publish batch is not the config's: only the built-in send chunk is timed
    assert sorted(p for p in plan[24] if p[0] == "combine") == [("combine", 1, 256), ("combine", 1, 512)]
    assert len(plan[24]) == (3 + 2) + 2


def test_choose_takes_the_fewest_sms_within_the_tolerance():
    times = {(20, "dispatch", 4, 256): 120.0, (20, "combine", 1, 256): 130.0,
             (24, "dispatch", 4, 256): 101.0, (24, "dispatch", 8, 512): 100.0, (24, "combine", 1, 512): 110.0,
             (32, "dispatch", 8, 512): 99.0, (32, "combine", 2, 512): 108.0,
             (16, "dispatch", 8, 512): 10.0}  # not a candidate
    chosen, best = tune.choose(times, (20, 24, 32), tolerance=0.02)
    assert chosen == 24
    assert best[24] == {"dispatch": (100.0, 8, 512), "combine": (110.0, 1, 512)}
    assert tune.choose(times, (20, 24, 32), tolerance=0.0)[0] == 32
    with pytest.raises(ValueError):
        tune.choose({(20, "dispatch", 1, 256): 1.0}, (20,))


def test_progress_in_a_log_prints_a_line_per_tenth():
    out = io.StringIO()
    bar = tune.Progress(40, stream=out)
    for i in range(40):
        bar.step(f"point {i}")
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 10 and "\r" not in out.getvalue()
    assert lines[-1].startswith("tune [" + "#" * 28 + "] 40/40")


def test_progress_on_a_terminal_redraws_one_line():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    out = Tty()
    bar = tune.Progress(3, stream=out)
    for _ in range(3):
        bar.step("x")
    bar.close()
    assert out.getvalue().count("\r") == 3 and out.getvalue().endswith("\n")
    silent = io.StringIO()
    tune.Progress(3, stream=silent, enabled=False).step()
    assert silent.getvalue() == ""


def test_parse_args_rejects_odd_sm_counts(capsys):
    with pytest.raises(SystemExit):
        tune.parse_args(["--sms", "20,23"])
    assert "must be even" in capsys.readouterr().err
    args = tune.parse_args(["--hidden", "4096", "--sms", "24,20,24", "--send", "4,2"])
    assert args.sms == (20, 24) and args.send == (2, 4) and args.hidden == 4096


def _tune(*argv, env=None):
    env = dict(os.environ, DEEPEP_CUPY_FORCE_NO_GPU="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "deepep_cupy.tuning", *argv], capture_output=True, text=True,
                          timeout=120, env=env)


def test_help():
    got = _tune("--help")
    assert got.returncode == 0, got.stderr
    assert "--hidden" in got.stdout and "--sms" in got.stdout and "mpirun" in got.stdout
    assert "\ncommands:\n  sms " in got.stdout and "\n  internode " in got.stdout


def test_without_gpus_one_clear_line():
    got = _tune("--hidden", "4096")  # DEEPEP_CUPY_FORCE_NO_GPU=1: no GPU, whatever this machine has
    assert got.returncode != 0
    lines = [line for line in got.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, got.stderr
    assert lines[0].startswith("python -m deepep_cupy.tuning: no GPU found; ") and "Traceback" not in got.stderr


def test_show_lists_the_store(store):
    got = _tune("--show", env={"DEEPEP_CUPY_CACHE_DIR": str(store.parent)})
    assert got.returncode == 0 and "no tuned configs" in got.stdout
    _save()
    got = _tune("--show", env={"DEEPEP_CUPY_CACHE_DIR": str(store.parent)})
    assert got.returncode == 0, got.stderr
    assert f"{GPU}, 8 ranks, hidden 7168" in got.stdout and "[24, 4, 512, 6, 132]" in got.stdout
