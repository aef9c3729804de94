"""Session settings of every test suite (each MPI rank is a pytest session of its own)."""

import os
import shutil
import tempfile

# Caches a test run would otherwise create in the user's home: deepep_cupy's kernel cache (read by
# deepep_cupy.jit.cache.cache_dir()), the one CuPy makes when it is imported, and matplotlib's font cache
# and IPython's profile (the plotting and notebook tests). Spelled out here so that loading this file imports nothing.
CACHE_ENVS = {"DEEPEP_CUPY_CACHE_DIR": "deepep_cupy", "CUPY_CACHE_DIR": "cupy", "MPLCONFIGDIR": "matplotlib",
              "IPYTHONDIR": "ipython"}


def pytest_configure(config):
    """Point every cache the user has not chosen at a temporary directory, removed at the end."""
    unset = [name for name in CACHE_ENVS if not os.environ.get(name)]
    if not unset:
        return
    root = tempfile.mkdtemp(prefix="deepep_cupy_test_cache_")
    for name in unset:
        os.environ[name] = os.path.join(root, CACHE_ENVS[name])

    def cleanup():
        for name in unset:
            os.environ.pop(name, None)
        shutil.rmtree(root, ignore_errors=True)

    config.add_cleanup(cleanup)
