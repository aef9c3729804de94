"""Benchmarks (not tests): ``mpirun -np <gpus> python -m deepep_cupy.bench [intranode|low_latency|baselines|all]``."""
