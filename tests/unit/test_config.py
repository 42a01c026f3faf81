import os
import stat

import pytest

from compushare.config import NodeConfig, Span, resolve_data_dir
from compushare.errors import UsageError
from compushare.net.identity import load_or_create_identity, peer_id_of


def test_data_dir_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPUSHARE_HOME", str(tmp_path / "env"))
    assert resolve_data_dir(None) == (tmp_path / "env").resolve()
    assert resolve_data_dir(tmp_path / "flag") == (tmp_path / "flag").resolve()
    monkeypatch.delenv("COMPUSHARE_HOME")
    assert "compushare" in str(resolve_data_dir(None)).lower()


def test_identity_persists_per_data_dir(tmp_path):
    (tmp_path / "a").mkdir()
    first = peer_id_of(load_or_create_identity(tmp_path / "a"))
    again = peer_id_of(load_or_create_identity(tmp_path / "a"))
    (tmp_path / "b").mkdir()
    other = peer_id_of(load_or_create_identity(tmp_path / "b"))
    assert first == again
    assert first != other
    mode = stat.S_IMODE(os.stat(tmp_path / "a" / "identity.ed25519").st_mode)
    assert mode == 0o600


def test_corrupt_identity_is_a_clear_error(tmp_path):
    (tmp_path / "identity.ed25519").write_bytes(b"short")
    with pytest.raises(UsageError, match="32-byte"):
        load_or_create_identity(tmp_path)


def test_toml_then_flags(tmp_path):
    (tmp_path / "config.toml").write_text(
        '[node]\nlisten = ["/ip4/127.0.0.1/tcp/4001"]\nbootstrap = ["/ip4/127.0.0.1/tcp/1/p2p/X"]\n'
        'blocks = "2:5"\n[limits]\nkv_budget_tokens = 100\n'
    )
    config = NodeConfig.build(tmp_path)
    assert config.listen == ("/ip4/127.0.0.1/tcp/4001",)
    assert config.bootstrap == ("/ip4/127.0.0.1/tcp/1/p2p/X",)
    assert config.blocks == Span(2, 5)
    assert config.limits.kv_budget_tokens == 100
    flagged = NodeConfig.build(tmp_path, blocks=Span(0, 1), listen=["/ip4/127.0.0.1/tcp/0"], bootstrap=None)
    assert flagged.blocks == Span(0, 1)
    assert flagged.listen == ("/ip4/127.0.0.1/tcp/0",)
    assert flagged.bootstrap == config.bootstrap


def test_bad_toml_and_span(tmp_path):
    (tmp_path / "config.toml").write_text("[node\n")
    with pytest.raises(UsageError, match="invalid TOML"):
        NodeConfig.build(tmp_path)
    for text in ("3:3", "5:2", "a:b", "7"):
        with pytest.raises(UsageError):
            Span.parse(text)


def test_relay_quotas_and_switches_come_from_toml_and_flags(tmp_path):
    (tmp_path / "config.toml").write_text('[node]\nrelay = false\nhole_punch = false\n[relay]\ncircuits = 3\n')
    config = NodeConfig.build(tmp_path)
    assert config.relay is False and config.hole_punch is False
    assert config.relay_quotas.circuits == 3 and config.relay_quotas.reservations == 32  # the rest: defaults
    assert NodeConfig.build(tmp_path, relay=True, hole_punch=True).relay is True
    (tmp_path / "config.toml").write_text("[relay]\ncircuit = 3\n")
    with pytest.raises(UsageError, match="unknown quota 'circuit'"):
        NodeConfig.build(tmp_path)
    (tmp_path / "config.toml").write_text("[relay]\ncircuits = 0\n")
    with pytest.raises(UsageError, match="circuits must be positive"):
        NodeConfig.build(tmp_path)
