from compushare.net.host import expand_unspecified, local_ipv4_addresses


def test_unspecified_listener_advertises_interface_addresses():
    assert expand_unspecified("/ip4/0.0.0.0/tcp/4001", ["10.0.0.5", "127.0.0.1"]) == [
        "/ip4/10.0.0.5/tcp/4001", "/ip4/127.0.0.1/tcp/4001"]
    assert expand_unspecified("/ip4/127.0.0.1/tcp/4001", ["10.0.0.5"]) == ["/ip4/127.0.0.1/tcp/4001"]


def test_local_addresses_are_concrete_and_loopback_last():
    ips = local_ipv4_addresses()
    assert "127.0.0.1" in ips and "0.0.0.0" not in ips
    assert ips[-1].startswith("127.")
