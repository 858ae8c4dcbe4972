"""The refit group's handshake (engines/fleet/handshake.py) without processes: a scripted peer."""
import pytest

from reshard_cli.errors import ConfigError
from reshard_cli.engines.fleet.handshake import handshake


class Peer:
    """Rank 0 is the caller; rank 1 answers each all_gather with what `peer` returns for the caller's object."""

    def __init__(self, peer):
        self.peer, self.calls = peer, 0

    def all_gather_object(self, obj):
        self.calls += 1
        return [obj, self.peer(obj)]


MODEL = [("a.weight", (4, 2), "bfloat16"), ("b.weight", (3,), "bfloat16")]


def test_equal_models_exchange_only_hashes():
    comm = Peer(lambda obj: obj)
    handshake(comm, "trainer 0", MODEL, None)
    assert comm.calls == 1


def test_a_peer_error_is_everyones_one_line():
    comm = Peer(lambda obj: {**obj, "role": "vLLM worker 0", "error": "dst: the layout has tp 1"})
    with pytest.raises(ConfigError, match=r"^refit rank 1 \(vLLM worker 0\): dst: the layout has tp 1$"):
        handshake(comm, "trainer 0", MODEL, None)


def test_different_transports_are_everyones_one_line():
    """A trainer told shm and a worker told auto would post messages the other never takes: refused before."""
    comm = Peer(lambda obj: {**obj, "role": "vLLM worker 0", "settings": {"transport": "auto"}})
    with pytest.raises(ConfigError, match=r"refit ranks 0 \(trainer 0\) and 1 \(vLLM worker 0\) were given different "
                                          r"transports: 'shm' and 'auto'"):
        handshake(comm, "trainer 0", MODEL, None, settings={"transport": "shm"})
    handshake(Peer(lambda obj: obj), "trainer 0", MODEL, None, settings={"transport": "shm"})


def test_different_models_name_the_first_difference():
    other = [("a.weight", (4, 4), "bfloat16"), ("b.weight", (3,), "bfloat16")]

    def peer(obj):
        if isinstance(obj, dict):  # the hash round: a different hash
            return {**obj, "role": "vLLM worker 0", "model": "0" * 64}
        return other  # the model round
    comm = Peer(peer)
    with pytest.raises(ConfigError) as info:
        handshake(comm, "trainer 0", MODEL, None)
    assert "refit ranks 0 (trainer 0) and 1 (vLLM worker 0) have different models: a.weight: [4, 2] bfloat16 vs " \
           "[4, 4] bfloat16" in str(info.value)
    assert comm.calls == 2


def test_the_refit_topology_is_the_same_on_every_rank():
    """None, a bundled name, a file's YAML text, or `auto`: each rank's domain key (NVML's, or its host's on a
    CPU) exchanged in the handshake, ranks with equal keys in one domain."""
    import torch

    from reshard_cli.engines.fleet.handshake import domain_key, refit_topology
    from reshard_cli.hw import nvml
    from reshard_cli.layouts.topology import NO_TOPOLOGY

    assert refit_topology("", [None, None]) is NO_TOPOLOGY
    assert refit_topology("dgx-h100", []).ranks_per_domain == 8
    assert refit_topology("name: f\ndomains: ['2-3']\n", []).domains == ((2, 3),)
    found = refit_topology("auto", ["host-a", "host-b", "nvl-1", "nvl-1"])
    assert found.domain_of(2) == found.domain_of(3) != found.domain_of(0) != found.domain_of(1)
    assert domain_key("", torch.device("cpu")) is None
    assert domain_key("auto", torch.device("cpu")) == nvml.rank_domain_key(nvml.discover(), 0)
    peer = Peer(lambda mine: {**mine, "role": "vLLM worker 0", "domain": "nvl-1"})
    agreed = handshake(peer, "trainer 0", MODEL, None, "host-a")
    assert agreed.domains == ["host-a", "nvl-1"] and agreed.open_updates == [False, False]
    assert peer.calls == 1  # the keys ride on the handshake's one exchange
