"""``Config.get_rdma_buffer_size_hint`` against DeepEP V1's formula (csrc/config.hpp), written out here
term by term as DeepEP states it, with its constants (8 ranks per NVLink domain, 128 top-k, 128 scales,
an 8-byte source meta, int64 top-k ids, a 16-byte int4 per slot)."""

import pytest

from deepep_cupy import Config

_INT, _INT64, _FLOAT, _INT4, _SOURCE_META = 4, 8, 4, 16, 8


def _deepep_rdma_hint(num_sms, nvl_send, nvl_recv, rdma_send, rdma_recv, hidden_bytes, num_ranks, nvl_peers=8):
    del nvl_send, nvl_recv
    if num_ranks <= nvl_peers:
        return 0
    assert num_ranks % nvl_peers == 0 and num_sms % 2 == 0
    rdma_recv = (rdma_recv + rdma_send - 1) // rdma_send * rdma_send  # Config's constructor rounds it up
    num_rdma_ranks = num_ranks // nvl_peers
    num_channels = num_sms // 2
    per = num_channels * num_rdma_ranks
    num_bytes = 0
    num_bytes += per * (nvl_peers * 2 + 2) * 2 * _INT
    num_bytes += per * rdma_recv * hidden_bytes * 2
    num_bytes += per * rdma_recv * _SOURCE_META * 2
    num_bytes += per * rdma_recv * 128 * _INT64 * 2
    num_bytes += per * rdma_recv * 128 * _FLOAT * 2
    num_bytes += per * rdma_recv * 128 * _FLOAT * 2
    num_bytes += per * rdma_recv * _INT4 * 2
    return (num_bytes + 127) // 128 * 128


# DeepEP's recommended dispatch/combine configs for 16..64 ranks, and a few others.
_CONFIGS = [(24, 36, 288, 20, 128), (24, 32, 288, 8, 128), (20, 4, 288, 12, 128), (24, 1, 288, 8, 128),
            (132, 32, 288, 8, 128), (20, 20, 480, 12, 128), (64, 6, 256, 6, 256), (2, 6, 256, 6, 128)]
_HIDDEN = [7168 * 2, 7168, 4096 * 2, 2048 * 2 + 16]  # BF16 and FP8 hidden 7168, smaller models


@pytest.mark.parametrize("cfg", _CONFIGS)
@pytest.mark.parametrize("hidden_bytes", _HIDDEN)
@pytest.mark.parametrize("num_ranks", [16, 32, 64])
def test_equals_deepep_with_domains_of_8(cfg, hidden_bytes, num_ranks):
    want = _deepep_rdma_hint(*cfg, hidden_bytes, num_ranks)
    config = Config(*cfg)
    assert config.get_rdma_buffer_size_hint(hidden_bytes, num_ranks) == want
    assert config.get_rdma_buffer_size_hint(hidden_bytes, num_ranks, 8) == want
    assert want > 0 and want % 128 == 0


def test_known_value():
    # 16 ranks, DeepEP's 16-rank dispatch config at 24 SMs, BF16 hidden 7168: worked out by hand.
    per_slot = 14336 + 8 + 1024 + 512 + 512 + 16
    want = 12 * 2 * (18 * 2 * 4) + 12 * 2 * 140 * 2 * per_slot  # rdma recv 128 rounds up to 140 (send 20)
    want = (want + 127) // 128 * 128
    assert Config(24, 36, 288, 20, 128).get_rdma_buffer_size_hint(14336, 16) == want


@pytest.mark.parametrize("num_ranks", [1, 2, 4, 8])
def test_zero_within_one_domain(num_ranks):
    cfg = Config(24, 6, 256, 6, 128)
    assert cfg.get_rdma_buffer_size_hint(14336, num_ranks) == 0
    assert cfg.get_rdma_buffer_size_hint(14336, num_ranks, num_ranks) == 0


@pytest.mark.parametrize("num_ranks,domain", [(2, 1), (4, 1), (4, 2), (8, 1), (8, 2), (8, 4), (16, 4), (32, 16)])
def test_other_domain_sizes(num_ranks, domain):
    """A domain of ``L`` ranks: the same formula with ``L`` where DeepEP has 8, over num_ranks // L domains."""
    for cfg in _CONFIGS:
        want = _deepep_rdma_hint(*cfg, 7168, num_ranks, nvl_peers=domain)
        assert want > 0
        assert Config(*cfg).get_rdma_buffer_size_hint(7168, num_ranks, domain) == want
        assert Config(*cfg).get_rdma_buffer_size_hint(7168, num_ranks, num_nvl_ranks=domain) == want


def test_rejects_bad_domains():
    cfg = Config(24, 6, 256, 6, 128)
    with pytest.raises(ValueError, match="multiple"):
        cfg.get_rdma_buffer_size_hint(14336, 12)
    with pytest.raises(ValueError, match="multiple"):
        cfg.get_rdma_buffer_size_hint(14336, 6, 4)
    with pytest.raises(ValueError, match="num_nvl_ranks"):
        cfg.get_rdma_buffer_size_hint(14336, 8, 0)
    with pytest.raises(ValueError, match="even"):
        Config(23, 6, 256, 6, 128).get_rdma_buffer_size_hint(14336, 16)
