"""Errors are exceptions with the daemon's code, message and ranks; both dbuf.Error and the built-in kind."""

from __future__ import annotations

import pickle

import pytest

import dbuf
from conftest import run_threads

SPEC = [dbuf.TensorSpec("w", (8, 8))]


def test_every_code_has_its_class_and_the_native_names_agree():
    for code in dbuf.ErrorCode:
        error = dbuf._errors._from_native(int(code), "m", [2, 5])
        assert isinstance(error, dbuf.Error) and error.code == code and error.ranks == (2, 5)
        assert type(error).__module__ == "dbuf" and getattr(dbuf, type(error).__name__) is type(error)
    names = {dbuf._dbuf._error_name(int(code)) for code in dbuf.ErrorCode}
    assert len(names) == len(dbuf.ErrorCode) and "cancelled" in names and "timeout" in names
    assert isinstance(dbuf._errors._from_native(7, "t", []), TimeoutError)
    assert isinstance(dbuf._errors._from_native(0, "v", []), ValueError)
    assert isinstance(dbuf._errors._from_native(8, "u", []), ConnectionError)
    copied = pickle.loads(pickle.dumps(dbuf.TimeoutError("late", [1, 3])))
    assert isinstance(copied, dbuf.TimeoutError) and copied.ranks == (1, 3) and str(copied) == "late"


def test_an_op_timeout_names_the_missing_ranks(fast_daemon):
    world = 4

    def rank(r: int):
        client = dbuf.Client(fast_daemon.socket)
        client.attach("late", r, world)
        if r in (1, 3):
            return client  # attached, alive, and never reaches the barrier
        with pytest.raises(dbuf.TimeoutError) as caught:
            client.barrier()
        return caught.value

    for error in run_threads(world, rank):
        if isinstance(error, dbuf.Error):
            assert error.ranks == (1, 3) and error.code == dbuf.ErrorCode.TIMEOUT
            assert "ranks 1, 3" in str(error) or "1 and 3" in str(error) or "1, 3" in str(error)


def test_a_registration_timeout_names_the_missing_rank(fast_daemon):
    client = dbuf.Client(fast_daemon.socket)
    client.attach("alone", 0, 2)
    with pytest.raises(dbuf.TimeoutError) as caught:
        client.register_group("g", SPEC)
    assert caught.value.ranks == (1,)


def test_specs_that_differ_between_ranks_are_a_conflict_naming_them(daemon):
    def rank(r: int):
        client = dbuf.Client(daemon.socket)
        client.attach("differ", r, 2)
        shape = (8, 8) if r == 0 else (8, 4)
        with pytest.raises(dbuf.ConflictError) as caught:
            client.register_group("g", [dbuf.TensorSpec("w", shape)])
        return caught.value

    for error in run_threads(2, rank):
        assert error.ranks == (0, 1)
        assert "w" in str(error)


def test_ops_that_differ_between_ranks_are_a_conflict(daemon):
    def rank(r: int):
        client = dbuf.Client(daemon.socket)
        client.attach("mismatch", r, 2)
        group = client.register_group("g", SPEC)
        group.acquire_slot()
        with pytest.raises(dbuf.ConflictError) as caught:
            if r == 0:
                group.all_gather()
            else:
                group.reduce_scatter()
        return caught.value

    for error in run_threads(2, rank):
        assert error.ranks == (1,)


def test_a_rank_taken_twice_is_a_conflict_and_the_session_is_still_usable(daemon):
    first = dbuf.Client(daemon.socket)
    first.attach("twice", 0, 2)
    second = dbuf.Client(daemon.socket)
    with pytest.raises(dbuf.ConflictError):
        second.attach("twice", 0, 2)
    assert first.noop().sequence == 0


def test_a_refused_attach_leaves_the_client_usable_for_a_corrected_one(daemon):
    client = dbuf.Client(daemon.socket)
    with pytest.raises(dbuf.InvalidArgumentError, match="rank 4 of world size 4"):
        client.attach("corrected", 4, 4)
    client.attach("corrected", 0, 1)  # dbufd closed the refused connection; attach connects again
    group = client.register_group("g", SPEC)
    group.unshard()
    assert group.is_unsharded
    client.detach()


def test_a_group_naming_a_tensor_twice_is_refused_naming_it(daemon):
    client = dbuf.Client(daemon.socket)
    client.attach("twice-named", 0, 1)
    with pytest.raises(dbuf.InvalidArgumentError, match="tensor 'w' is named twice"):
        client.register_group("g", [dbuf.TensorSpec("w", (4,)), dbuf.TensorSpec("w", (6,))])
    group = client.register_group("g", [dbuf.TensorSpec("w", (4,)), dbuf.TensorSpec("v", (6,))])
    assert [t.name for t in group.plan.tensors] == ["w", "v"]
    client.detach()
