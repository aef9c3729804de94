"""The kernel cache and the tuning store trust nothing they read back: altered, edited, moved, foreign or
shared entries are refused and rebuilt; files are private whatever the umask; lock files are never
followed through a symlink; lock waits are bounded. No GPU needed."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
import shutil
import stat
import time
import warnings
from pathlib import Path

import pytest

from deepep_cupy import tuning
from deepep_cupy.errors import DeepEPTimeoutError
from deepep_cupy.jit import BuildSpec, CacheTrustWarning, build, cache_dir
from deepep_cupy.jit import cache as jit_cache
from deepep_cupy.jit import files as jit_files
from deepep_cupy.jit.cache import check_entry, entry_for

KERNEL = r"""
template <int kScale>
__global__ void scale_kernel(int* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = (i ^ 0x5a5a) * kScale * BASE;
}
"""
ARCH = "sm_90"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private source tree with one small kernel, an empty cache, and this process's warning unspent."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "k.cu").write_text(KERNEL)
    monkeypatch.setenv("DEEPEP_CUPY_SOURCE_DIR", str(src))
    monkeypatch.setenv("DEEPEP_CUPY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("DEEPEP_CUPY_CACHE_LOCK_TIMEOUT_S", raising=False)
    monkeypatch.setattr(jit_cache, "_warned", False)
    return tmp_path / "cache"


def _spec(scale: int = 3, base: int = 7) -> BuildSpec:
    return BuildSpec.make("k.cu", {"BASE": base}, [f"scale_kernel<{scale}>"])


def _flip(path: Path, count: int = 64) -> None:
    """Invert ``count`` bytes at a random place: the size stays the same."""
    data = bytearray(path.read_bytes())
    start = random.randrange(64, len(data) - count)
    data[start:start + count] = bytes(b ^ 0xFF for b in data[start:start + count])
    path.write_bytes(bytes(data))


def _trust_warnings(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, CacheTrustWarning)]


def test_altered_cubin_of_the_same_size_is_rebuilt_with_one_warning(cache):
    first = build(_spec(), ARCH)
    good = first.cubin_path.read_bytes()
    _flip(first.cubin_path)
    assert first.cubin_path.stat().st_size == len(good)
    with pytest.warns(CacheTrustWarning, match="SHA-256") as record:
        again = build(_spec(), ARCH)
    assert str(first.cubin_path.parent) in _trust_warnings(record)[0]
    assert not again.from_cache and again.cubin_path == first.cubin_path
    meta = json.loads((again.cubin_path.parent / "meta.json").read_text())
    assert hashlib.sha256(again.cubin_path.read_bytes()).hexdigest() == meta["cubin_sha256"]
    assert build(_spec(), ARCH).from_cache

    _flip(again.cubin_path)  # a second refusal in the same process is rebuilt without another warning
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert not build(_spec(), ARCH).from_cache
    assert not _trust_warnings(record)


@pytest.mark.filterwarnings("ignore::deepep_cupy.jit.CacheTrustWarning")
def test_edited_lowered_names_are_rebuilt(cache):
    first = build(_spec(), ARCH)
    meta_path = first.cubin_path.parent / "meta.json"
    meta = json.loads(meta_path.read_text())
    real = meta["lowered_names"]["scale_kernel<3>"]
    meta["lowered_names"]["scale_kernel<3>"] = real.replace("Li3E", "Li4E") + "_x"
    meta_path.write_text(json.dumps(meta))
    entry = first.cubin_path.parent
    assert "digest" in check_entry(entry, entry_for(_spec(), ARCH)[1])[1]
    again = build(_spec(), ARCH)
    assert not again.from_cache and again.lowered_names == {"scale_kernel<3>": real}


@pytest.mark.filterwarnings("ignore::deepep_cupy.jit.CacheTrustWarning")
def test_entry_moved_under_another_key_is_refused(cache):
    one = build(_spec(scale=3), ARCH)
    two = build(_spec(scale=5), ARCH)
    shutil.rmtree(two.cubin_path.parent)
    shutil.copytree(one.cubin_path.parent, two.cubin_path.parent)  # well formed, but for another spec
    meta, reason = check_entry(two.cubin_path.parent, entry_for(_spec(scale=5), ARCH)[1])
    assert meta is None and "built from something else" in reason and "key" in reason
    again = build(_spec(scale=5), ARCH)
    assert not again.from_cache and again.lowered_names != one.lowered_names
    assert again.cubin_path.read_bytes() != one.cubin_path.read_bytes()


@pytest.mark.filterwarnings("ignore::deepep_cupy.jit.CacheTrustWarning")
@pytest.mark.parametrize("target", [".", "kernel.cubin", "meta.json"])
@pytest.mark.parametrize("bit, who", [(0o020, "group"), (0o002, "others")])
def test_entry_writable_by_others_is_refused(cache, target, bit, who):
    first = build(_spec(), ARCH)
    path = first.cubin_path.parent / target
    os.chmod(path, stat.S_IMODE(path.stat().st_mode) | bit)
    meta, reason = check_entry(first.cubin_path.parent, entry_for(_spec(), ARCH)[1])
    assert meta is None and f"writable by {who}" in reason
    again = build(_spec(), ARCH)
    assert not again.from_cache
    for p in (again.cubin_path.parent, again.cubin_path, again.cubin_path.parent / "meta.json"):
        assert not p.stat().st_mode & 0o077, p


def test_entry_of_another_user_is_refused(cache, monkeypatch):
    first = build(_spec(), ARCH)
    claims = entry_for(_spec(), ARCH)[1]
    assert check_entry(first.cubin_path.parent, claims)[0] is not None
    other = os.geteuid() + 4242
    monkeypatch.setattr(jit_files, "current_owner", lambda: other)  # this process as another user
    meta, reason = check_entry(first.cubin_path.parent, claims)
    assert meta is None and f"not {other}" in reason


@pytest.mark.filterwarnings("ignore::deepep_cupy.jit.CacheTrustWarning")
@pytest.mark.parametrize("target", [".", "kernel.cubin"])
def test_entry_owned_by_another_user_is_rebuilt(cache, target):
    first = build(_spec(), ARCH)
    path = first.cubin_path.parent / target
    try:
        os.chown(path, 65534, 65534)
    except PermissionError:
        pytest.skip("changing a file's owner needs root")
    again = build(_spec(), ARCH)
    assert not again.from_cache
    assert again.cubin_path.parent.stat().st_uid == os.geteuid() == again.cubin_path.stat().st_uid


def test_symlinked_cubin_is_refused(cache, tmp_path):
    first = build(_spec(), ARCH)
    elsewhere = tmp_path / "planted.cubin"
    shutil.move(first.cubin_path, elsewhere)  # the right bytes, but through a link
    os.symlink(elsewhere, first.cubin_path)
    with pytest.warns(CacheTrustWarning, match="symbolic link"):
        again = build(_spec(), ARCH)
    assert not again.from_cache and not again.cubin_path.is_symlink()


def _modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.lstat().st_mode) for p in [root, *root.rglob("*")]}


@pytest.mark.parametrize("umask", [0o000, 0o277])
def test_cache_is_private_whatever_the_umask(cache, monkeypatch, umask):
    root = cache / "a" / "b"  # three levels to create
    monkeypatch.setenv("DEEPEP_CUPY_CACHE_DIR", str(root))
    old = os.umask(umask)
    try:
        compiled = build(_spec(), ARCH)
        tuning.save_entry({"gpu": "G", "num_ranks": 2, "hidden": 128})
    finally:
        os.umask(old)
    modes = _modes(cache)
    assert compiled.cubin_path.relative_to(cache).as_posix() in modes
    assert any(name.endswith(".lock-tuned_configs.json") for name in modes)
    assert len([n for n in modes if ".lock-" in n]) == 2
    for name, mode in modes.items():
        expected = 0o700 if (cache / name).is_dir() else 0o600
        assert mode == expected, f"{name}: {mode:04o}"
    assert build(_spec(), ARCH).from_cache


def test_symlink_at_the_lock_path_is_not_followed(cache, tmp_path):
    entry = entry_for(_spec(), ARCH)[0]
    entry.parent.mkdir(parents=True)
    missing = tmp_path / "victim" / "created-by-the-lock"
    (tmp_path / "victim").mkdir()
    kept = tmp_path / "victim" / "kept"
    kept.write_text("unchanged")
    os.chmod(kept, 0o644)
    for target in (missing, kept):
        lock = entry.parent / f".lock-{entry.name}"
        lock.unlink(missing_ok=True)
        os.symlink(target, lock)
        jit_cache._warned = False
        with pytest.warns(CacheTrustWarning, match=f"lock file {lock}.*symbolic link"):
            compiled = build(_spec(), ARCH)
        assert compiled.cubin_path.is_file() and lock.is_symlink()
        shutil.rmtree(entry)
    assert not missing.exists()
    assert kept.read_text() == "unchanged" and stat.S_IMODE(kept.stat().st_mode) == 0o644


def test_symlink_at_the_tuning_lock_is_not_followed(cache, tmp_path):
    cache.mkdir()
    target = tmp_path / "created-by-the-lock"
    os.symlink(target, cache / f".lock-{tuning.STORE_NAME}")
    with pytest.warns(CacheTrustWarning, match="symbolic link"):
        path = tuning.save_entry({"gpu": "G", "num_ranks": 2, "hidden": 128})
    assert not target.exists() and path.is_file()
    assert list(tuning.read_entries(path)) == ["G|2|128"]


def test_tuned_configs_of_another_user_or_shared_are_ignored(cache, monkeypatch):
    path = tuning.save_entry({"gpu": "G", "num_ranks": 2, "hidden": 128})
    os.chmod(path, 0o622)
    with pytest.warns(CacheTrustWarning, match="writable by group and others"):
        assert tuning.read_entries(path) == {}
    os.chmod(path, 0o600)
    assert tuning.read_entries(path)
    monkeypatch.setattr(jit_files, "current_owner", lambda: os.geteuid() + 1)
    with pytest.warns(CacheTrustWarning, match="owned by uid"):
        assert tuning.read_entries(path) == {}


@pytest.mark.parametrize("which", ["kernel cache", "tuning store"])
def test_held_lock_raises_a_named_timeout_within_the_bound(cache, monkeypatch, which):
    bound = 0.4
    monkeypatch.setenv("DEEPEP_CUPY_CACHE_LOCK_TIMEOUT_S", str(bound))
    if which == "kernel cache":
        entry = entry_for(_spec(), ARCH)[0]
        lock = entry.parent / f".lock-{entry.name}"
        attempt = lambda: build(_spec(), ARCH)  # noqa: E731
    else:
        lock = cache / f".lock-{tuning.STORE_NAME}"
        attempt = lambda: tuning.save_entry({"gpu": "G", "num_ranks": 2, "hidden": 128})  # noqa: E731
    lock.parent.mkdir(parents=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)  # another open file: flock treats it as another holder
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        start = time.monotonic()
        with pytest.raises(DeepEPTimeoutError, match=f"could not lock {lock} within {bound:g} s"):
            attempt()
        assert bound <= time.monotonic() - start < bound + 3
    finally:
        os.close(fd)
    attempt()  # released: it goes through


@pytest.mark.parametrize("text", ["0", "-1", "inf", "nan", "soon", "1e400"])
def test_lock_bound_must_be_finite_and_positive(monkeypatch, text):
    monkeypatch.setenv("DEEPEP_CUPY_CACHE_LOCK_TIMEOUT_S", text)
    with pytest.raises(ValueError, match="DEEPEP_CUPY_CACHE_LOCK_TIMEOUT_S"):
        jit_files.lock_timeout_s()


def test_lock_bound_default_and_value(monkeypatch):
    monkeypatch.delenv("DEEPEP_CUPY_CACHE_LOCK_TIMEOUT_S", raising=False)
    assert jit_files.lock_timeout_s() == jit_files.DEFAULT_LOCK_TIMEOUT_S
    value = round(random.uniform(0.5, 50.0), 3)
    monkeypatch.setenv("DEEPEP_CUPY_CACHE_LOCK_TIMEOUT_S", f" {value} ")
    assert jit_files.lock_timeout_s() == value


def test_stale_temporaries_of_other_users_are_left_alone(cache, monkeypatch):
    build(_spec(), ARCH)
    root = Path(cache_dir())
    ours = root / ".tmp-ours-x"
    ours.mkdir()
    old = time.time() - 2 * jit_cache._STALE_TMP_S
    os.utime(ours, (old, old))
    theirs = root / ".tmp-theirs-x"
    theirs.mkdir()
    os.utime(theirs, (old, old))
    real_lstat = Path.lstat

    def lstat(path):
        st = real_lstat(path)
        if path.name == theirs.name:  # as if another user had made it
            values = list(st)
            values[stat.ST_UID] = st.st_uid + 1
            return os.stat_result(values)
        return st

    monkeypatch.setattr(Path, "lstat", lstat)
    jit_cache._remove_stale_tmp(root)
    assert not ours.exists() and theirs.exists()
