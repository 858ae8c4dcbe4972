"""The refit group's handshake (engines/vllm/handshake.py) without processes: a scripted peer."""
import pytest

from reshard_cli.errors import ConfigError
from reshard_cli.engines.vllm.handshake import handshake


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
