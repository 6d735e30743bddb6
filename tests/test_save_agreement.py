"""megatron_sat/training/save_agreement.py called directly, in this process: a rank-local step's failure returned,
not raised; Megatron-Core's two coordinator writes (the torch writer's .metadata, metadata.json) held under
`holding()` and raised outside it; `first` over a real one-rank gloo group. A second; mutation testing's selection
(docs/development.md). The promise they carry, one line on every rank whichever write fails, is checked with two
ranks on a filled tmpfs by tests/test_faults.py::test_a_full_disk_fails_the_save_on_every_rank_whichever_write_it_stops.
"""

import os

import pytest
import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing import serialization
from megatron.core.dist_checkpointing.core import CheckpointingConfig
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
from torch.distributed.checkpoint.metadata import Metadata

from megatron_sat.training import save_agreement


def test_a_step_is_attempted_only_where_asked_and_its_failure_returned():
    ran = []
    assert save_agreement.attempt(lambda: ran.append(1)) is None and ran == [1]
    failure = save_agreement.attempt(lambda: open("/nonexistent/folder/file", "w"))
    assert isinstance(failure, FileNotFoundError)
    assert save_agreement.attempt(lambda: ran.append(2), here=False) is None and ran == [1]
    with pytest.raises(KeyboardInterrupt):  # not a write's failure: raised at once
        save_agreement.attempt(lambda: (_ for _ in ()).throw(KeyboardInterrupt()))


@pytest.fixture(autouse=True)
def unwrapped():
    """Megatron-Core's two writes as megatron-core defines them, before each test and after: so that each test sees
    save_agreement install its wrappers (mutation testing runs the tests in a process where an earlier run had)."""
    def restore():
        for owner, name in ((FileSystemWriterAsync, "finish"), (serialization, "save_config")):
            write = getattr(owner, name)
            while hasattr(write, "msat_holds"):
                write = write.__wrapped__
            setattr(owner, name, write)

    restore()
    yield
    restore()


def _metadata_write(folder):
    """Megatron-Core's two writes of rank 0 alone, into `folder`."""
    writer = FileSystemWriterAsync(folder)
    return (lambda: writer.finish(Metadata(state_dict_metadata={}), []),
            lambda: serialization.save_config(CheckpointingConfig("torch_dist", 1), folder))


def test_the_coordinator_writes_are_held_inside_holding_and_raised_outside(tmp_path):
    gone = str(tmp_path / "gone")  # a folder that is not there: each write fails
    finish, save_config = _metadata_write(gone)
    assert save_agreement.take() is None
    with save_agreement.holding():
        assert finish() is None
        first = save_agreement.take()
        assert isinstance(first, FileNotFoundError) and save_agreement.take() is None  # taken: cleared
        assert save_config() is None and save_config() is None
        held = save_agreement.take()
        assert isinstance(held, FileNotFoundError) and save_agreement.take() is None
    for write in (finish, save_config):  # outside: as Megatron-Core wrote them
        with pytest.raises(FileNotFoundError):
            write()
    assert save_agreement.take() is None
    with save_agreement.holding():  # the first failure is kept, a later one does not replace it
        finish()
        kept = save_agreement._held
        save_config()
        assert save_agreement.take() is kept
    with save_agreement.holding(), pytest.raises(ZeroDivisionError):  # a failure inside, not of a write: raised
        raise ZeroDivisionError("not a write's")
    with pytest.raises(FileNotFoundError):  # holding ended with the exception
        finish()
    wrapped = FileSystemWriterAsync.finish, serialization.save_config
    with save_agreement.holding():
        pass
    assert (FileSystemWriterAsync.finish, serialization.save_config) == wrapped  # wrapped once, however often held
    for write, name in zip(wrapped, ("finish", "save_config")):
        assert write.msat_holds is True and write.__name__ == name and not hasattr(write.__wrapped__, "msat_holds")


def test_a_megatron_core_without_those_writes_is_named(monkeypatch):
    """A megatron-core whose save is laid out otherwise: one line naming what is missing and what to look at."""
    monkeypatch.delattr(serialization, "save_config")
    with pytest.raises(RuntimeError) as missing, save_agreement.holding():
        pass
    assert str(missing.value) == ("megatron-core has no megatron.core.dist_checkpointing.serialization.save_config "
                                  "(megatron_sat/training/save_agreement.py was written for 0.19's dist-checkpoint "
                                  "save)")


def test_the_writes_go_through_when_they_can(tmp_path):
    folder = tmp_path / "ok"
    folder.mkdir()
    finish, save_config = _metadata_write(str(folder))
    with save_agreement.holding():
        finish()
        save_config()
    assert save_agreement.take() is None and (folder / "metadata.json").read_text().startswith("{")
    assert (folder / ".metadata").stat().st_size > 0


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_first_tells_every_rank_the_reason(one_rank_group):
    """One rank here: its reason or None. The lowest failing rank's among several, on every rank, is checked by the
    two-rank full-disk test."""
    assert save_agreement.first(None) is None
    assert save_agreement.first("the disk is full") == "the disk is full"
    assert save_agreement.first("") == ""  # a reason that is empty is still a failure
    assert torch.distributed.get_world_size() == 1 and os.getpid()
