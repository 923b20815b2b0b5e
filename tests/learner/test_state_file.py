"""Training state without pickle: safetensors for the tensors, JSON for the structure around them."""

import pytest
import torch

from rollstream.consumer.learn.state_file import StateFileError, load_state, save_state


def test_an_optimizer_and_schedule_state_round_trips_and_tied_tensors_are_stored_once(tmp_path) -> None:
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    shared = torch.arange(6.0)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
             "tied": (shared, shared), "misc": [None, True, 3, 2.5, "s", {"$odd": 1}]}
    state["scheduler"].pop("lr_lambdas")  # a list of callables' states (None here); nothing a checkpoint needs
    save_state(state, tmp_path / "s.safetensors")
    loaded = load_state(tmp_path / "s.safetensors")
    torch.testing.assert_close(loaded["model"], state["model"])
    assert loaded["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    assert set(loaded["optimizer"]["state"]) == {0, 1}  # int keys (parameter indices) stay ints
    torch.testing.assert_close(loaded["optimizer"]["state"][0]["exp_avg"], state["optimizer"]["state"][0]["exp_avg"])
    assert loaded["misc"] == state["misc"] and isinstance(loaded["tied"], tuple)
    torch.testing.assert_close(loaded["tied"][1], shared)
    assert (tmp_path / "s.safetensors").read_bytes()[:2] != b"\x80\x04"  # not a pickle


def test_what_cannot_be_stored_without_pickle_is_refused_with_its_place(tmp_path) -> None:
    with pytest.raises(StateFileError, match="/sched: a builtins.builtin_function_or_method cannot be stored"):
        save_state({"sched": print}, tmp_path / "x.safetensors")
    (tmp_path / "other.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(StateFileError, match="not a rollstream state file"):
        load_state(tmp_path / "other.safetensors")
