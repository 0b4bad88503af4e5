"""The store's trust boundary on one machine (store/trust.py): the --cache-disk folder must be private to the
server's user, the --cache-ram folder is one no one else can plant, and another user's files are never indexed
or restored. Also: a taken port is reported before the banner (cli.main)."""

from __future__ import annotations

import os
import socket
import stat
import time

import numpy as np
import pytest
import strata_sessionfile as sf
from strata_server.cli import PORT_TAKEN, load_config, main
from strata_server.config import ConfigError, cache_disk_warnings
from strata_server.ledger import SlotLedger
from strata_server.store import StoreSettings, store_settings
from strata_server.store.folder import StoreFolder
from strata_server.store.names import Fingerprints, conversation_name
from strata_server.store.store import SessionStore
from strata_server.store.trust import STALE_AFTER_S, StoreFolderRefused, create_private, ram_folder
from strata_server.tokens import as_tokens
from strata_sessionfile.testing import fake_identity, memory_adapter_factory

OTHER_UID = 4242  # a user the server is not
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")


def test_a_cache_disk_others_can_write_in_is_refused_unless_the_flag_says_warn(tmp_path, fake_model):
    folder = tmp_path / "store"
    folder.mkdir(mode=0o700)
    os.chmod(folder, 0o777)
    with pytest.raises(ConfigError) as info:
        load_config(["--model", str(fake_model), "--cache-disk", str(folder)])
    (problem,) = info.value.problems
    assert problem.startswith("cache_disk:") and "writable by group or others (mode 0777)" in problem
    assert "--cache-disk-loose-permissions" in problem
    config = load_config(
        ["--model", str(fake_model), "--cache-disk", str(folder), "--cache-disk-loose-permissions"]
    )
    assert ["0777" in w for w in cache_disk_warnings(config)] == [True]
    os.chmod(folder, 0o750)  # readable by the group, writable by no one else: accepted
    assert cache_disk_warnings(load_config(["--model", str(fake_model), "--cache-disk", str(folder)])) == []


@as_root
def test_a_cache_disk_of_another_user_is_refused(tmp_path, fake_model):
    folder = tmp_path / "theirs"
    folder.mkdir(mode=0o700)
    os.chown(folder, OTHER_UID, -1)
    with pytest.raises(ConfigError) as info:
        load_config(["--model", str(fake_model), "--cache-disk", str(folder)])
    assert [f"owned by uid {OTHER_UID}" in p for p in info.value.problems] == [True]


def test_the_ram_folder_is_unpredictable_private_and_never_one_planted(tmp_path, fake_model):
    flags = ["--model", str(fake_model), "--cache-ram", "16", "--port", "9123"]
    first, second = (store_settings(load_config(flags)).folder for _ in range(2))
    assert first != second and first.name.startswith(f"strata-cache-ram-{os.geteuid()}-9123-")
    folder = ram_folder(tmp_path, 9123)
    fd = create_private(folder)
    try:
        info = os.lstat(folder)
        assert stat.S_ISDIR(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o700
        assert info.st_uid == os.geteuid()
    finally:
        os.close(fd)
    target = tmp_path / "attacker"
    target.mkdir()
    planted = ram_folder(tmp_path, 9123)
    planted.symlink_to(target)
    with pytest.raises(StoreFolderRefused, match="exists already"):
        StoreFolder(planted, private=True).create()
    assert planted.is_symlink() and list(target.iterdir()) == []  # nothing written through the link


def test_a_dead_servers_ram_folder_is_removed_a_live_ones_kept(tmp_path):
    live, dead = ram_folder(tmp_path, 1), ram_folder(tmp_path, 2)
    live_fd = create_private(live)
    os.close(create_private(dead))  # its lock dies with the descriptor, as with its process
    old = time.time() - 2 * STALE_AFTER_S
    for path in (live, dead):
        os.utime(path, (old, old))
    fd = create_private(ram_folder(tmp_path, 3))
    os.close(fd)
    os.close(live_fd)
    assert live.is_dir() and not dead.exists()


@as_root
def test_files_of_another_user_are_never_indexed_or_restored(tmp_path):
    identity = fake_identity("ours")
    fingerprints = Fingerprints(identity.model.fingerprint.hex(), identity.config.fingerprint.hex())
    folder = StoreFolder(tmp_path)

    def stored(seed: int) -> str:
        scratch = tmp_path / "scratch.tmp"
        sf.save(scratch, memory_adapter_factory(n_tokens=300, identity=identity)(seed))
        tokens = as_tokens(np.frombuffer(sf.inspect(scratch).metadata.state.tokens, dtype="<i4"))
        name = conversation_name(fingerprints, tokens)
        scratch.rename(folder.file(name))
        return name

    ours, planted, planted_pending = stored(1), stored(2), stored(3)
    os.rename(folder.file(planted_pending), folder.pending(planted_pending))
    for path in (folder.file(planted), folder.pending(planted_pending)):
        os.chown(path, OTHER_UID, -1)
    store = SessionStore(
        StoreSettings(folder=tmp_path, max_bytes=1 << 30, min_reuse=1, idle_s=0),
        engine=None,
        ledger=SlotLedger(1),
    )
    store.fingerprints = fingerprints
    store.scan()
    assert [c.name for c in store.index.over_limit(0)] == [ours]
    assert folder.pending(planted_pending).exists()  # another user's file is left alone, not committed
    assert folder.trusted(ours) and not folder.trusted(planted)
    os.chown(folder.file(ours), OTHER_UID, -1)  # replaced after the scan: refused at its restore
    assert not folder.trusted(ours)


def test_a_taken_port_is_reported_before_the_banner(smollm2_path, capsys):
    """The model is checked first (a refused file exits 3 whatever the port), then the port."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["--model", str(smollm2_path), "--port", str(port)]) == PORT_TAKEN
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1 port {port}: the port is taken" in err
    assert "http://" not in err  # no banner
