"""A hub id without network fails at once (issue 52 item 7): one bounded probe instead of
the hub client's retries (52 s measured before), a one-line error that names
``HF_HUB_OFFLINE=1`` and local model directories, and a cached model loads from the cache.

Nothing here reaches the network: the probe is replaced, or aimed at this machine, and every
test forbids connections to anything but the loopback address."""

from __future__ import annotations

import socket
import time

import pytest
from huggingface_hub import constants

from lightkv.cli import main
from lightkv.generate import GenerateError, hub, load_model

REPO = "some-org/some-model"


@pytest.fixture(autouse=True)
def no_network(monkeypatch, tmp_path):
    """No connection leaves the machine; an empty Hugging Face cache; the hub's probe not
    yet taken; ``HF_HUB_OFFLINE`` off unless a test sets it."""
    real = socket.create_connection

    def local_only(address, *args, **kwargs):
        if address[0] not in ("127.0.0.1", "localhost"):
            raise AssertionError(f"a test tried to reach {address}")
        return real(address, *args, **kwargs)

    monkeypatch.setattr(socket, "create_connection", local_only)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    probe = hub.hub_reachable
    probe.cache_clear()
    yield
    probe.cache_clear()


@pytest.fixture
def unreachable(monkeypatch):
    """The hub does not answer, and transformers is never asked (it would retry)."""
    monkeypatch.setattr(hub, "hub_reachable", lambda: False)

    def never(*args, **kwargs):
        raise AssertionError("from_pretrained was called for a hub id the hub cannot serve")

    import transformers

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", never)


def _cache(tmp_path, repo: str) -> None:
    """``repo``'s config in the local cache, laid out as the hub client writes it."""
    root = tmp_path / "hf-cache" / ("models--" + repo.replace("/", "--"))
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text("0" * 40)
    snap = root / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")


def test_an_unreachable_hub_id_fails_at_once_in_one_line(unreachable):
    t0 = time.perf_counter()
    with pytest.raises(GenerateError) as e:
        load_model(REPO)
    assert time.perf_counter() - t0 < 1.0  # before transformers is even imported
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{REPO}: the Hugging Face hub cannot be reached")
    assert "HF_HUB_OFFLINE=1" in msg and "local model directory" in msg and "--model ./DIR" in msg


def test_hf_hub_offline_skips_the_probe_and_says_why(monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    def probed():
        raise AssertionError("probed the hub although HF_HUB_OFFLINE is set")

    monkeypatch.setattr(hub, "hub_reachable", probed)
    with pytest.raises(GenerateError) as e:
        hub.hub_access(REPO)
    assert "not in the local Hugging Face cache, and HF_HUB_OFFLINE=1" in str(e.value)
    assert "local model directory" in str(e.value)


def test_a_cached_model_loads_from_the_cache_without_network(unreachable, tmp_path, monkeypatch):
    _cache(tmp_path, REPO)
    assert hub.hub_access(REPO) == {"local_files_only": True}
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert hub.hub_access(REPO) == {"local_files_only": True}


def test_a_reachable_hub_is_asked(monkeypatch):
    monkeypatch.setattr(hub, "hub_reachable", lambda: True)
    assert hub.hub_access(REPO) == {}


def test_the_probe_is_bounded_and_reads_the_proxy(monkeypatch):
    with socket.socket() as closed:  # a port nobody listens on: refused at once
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    t0 = time.perf_counter()
    assert not hub.reachable("127.0.0.1", port, timeout=2.0)
    assert time.perf_counter() - t0 < 2.5
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        assert hub.reachable("127.0.0.1", server.getsockname()[1])
    for var in hub.PROXY_VARIABLES:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", "https://hub.example:8443")
    assert hub.hub_address() == ("hub.example", 8443)
    monkeypatch.setenv("HTTPS_PROXY", "proxy.example:3128")
    assert hub.hub_address() == ("proxy.example", 3128)


def test_generate_with_an_unreachable_hub_id(unreachable, tmp_path, capsys):
    """The command line's path: the default preset reads the depth first (it asked the hub
    too, with retries), then the model loads; neither calls transformers here."""
    from PIL import Image

    image = tmp_path / "x.png"
    Image.new("RGB", (8, 8)).save(image)
    code = main(["generate", "--model", REPO, "--image", str(image), "--prompt", "hi"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"lightkv: error: {REPO}: the Hugging Face hub cannot be reached")
    assert "HF_HUB_OFFLINE=1" in err[0]


def test_lmms_eval_with_an_unreachable_hub_id(unreachable):
    """``--model lightkv --model_args pretrained=ORG/NAME`` fails at once the same way (run by
    `make test-lmms-eval`, where lmms-eval is installed)."""
    pytest.importorskip("lmms_eval", reason="lmms-eval is not installed (`make lmms-eval`)")
    from lightkv.integrations.lmms_eval import _load

    with pytest.raises(GenerateError, match="HF_HUB_OFFLINE=1") as info:
        _load(REPO, "float32", None, None)
    assert "\n" not in str(info.value)
