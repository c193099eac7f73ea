"""The training command: a short run learns, the data options work, and a DistributedDataParallel
step on two processes updates the parameters as one process on the whole batch does."""

import faulthandler
import os
import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from transformer_kernels import train as train_module
from transformer_kernels.train import TrainConfig, parse_args, train

MODELS = ["transformer", "convs2s"]


@pytest.mark.parametrize("model", MODELS)
def test_short_run_lowers_the_loss_and_decodes(model, capsys):
    summary = train(parse_args(["--model", model, "--preset", "tiny", "--steps", "150", "--batch-size", "32",
                                "--lr", "3e-3", "--examples", "2"]))
    out = capsys.readouterr().out
    assert "exact match:" in out and out.count("greedy:") == 2 and len(summary["examples"]) == 2
    # From the uniform guess, log(36 words) = 3.6, to below it: the model learned.
    assert summary["first_loss"] > 3.5 and summary["final_loss"] < summary["first_loss"] - 0.25


def test_tsv_data(tmp_path, capsys):
    data = tmp_path / "pairs.tsv"
    lines = [f"a{i % 5} b{i % 3}\tx{i % 3} y{i % 5} z\n" for i in range(100)]
    data.write_text("".join(lines), encoding="utf-8")
    summary = train(TrainConfig(model="convs2s", preset="tiny", steps=3, batch_size=8, data=str(data), examples=1))
    assert summary["examples"][0][1] == "x0 y1 z"  # pair 36 is the first held out
    assert all(torch.isfinite(torch.tensor(summary[k])) for k in ("first_loss", "final_loss"))


def test_tsv_errors(tmp_path):
    bad = tmp_path / "bad.tsv"
    bad.write_text("only one column\n" * 100, encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad.tsv:1: expected 'source<TAB>target'"):
        train(TrainConfig(data=str(bad), steps=1))


def test_tsv_source_without_tokens_is_named(tmp_path):
    data = tmp_path / "pairs.tsv"
    data.write_text("a b\tx\n" * 80 + " \ty z\n" + "a b\tx\n" * 80, encoding="utf-8")
    with pytest.raises(ValueError, match=r"pairs.tsv:81: the source \(before the tab\) has no token"):
        train(TrainConfig(data=str(data), steps=1))


def test_the_command_reports_a_bad_configuration_or_data_file_without_a_traceback(tmp_path, capsys):
    assert train_module.main(["--data", str(tmp_path / "missing.tsv"), "--steps", "1"]) == 2
    assert "transformer_kernels.train: error: [Errno 2] No such file or directory" in capsys.readouterr().err
    data = tmp_path / "pairs.tsv"
    data.write_text("a b\tx\n" * 70, encoding="utf-8")
    assert train_module.main(["--data", str(data), "--steps", "1", "--batch-size", "8"]) == 2
    assert "error: batch_size (8) exceeds the 6 training pairs" in capsys.readouterr().err
    latin1 = tmp_path / "latin1.tsv"
    latin1.write_bytes("caf\u00e9 b\tx\n".encode("latin-1") * 70)
    assert train_module.main(["--data", str(latin1), "--steps", "1"]) == 2
    assert f"error: {latin1}: not UTF-8 text" in capsys.readouterr().err
    assert train_module.main(["--data", "", "--steps", "1"]) == 2  # not the synthetic task
    assert "No such file or directory" in capsys.readouterr().err


def test_batch_larger_than_the_training_pairs_is_named(tmp_path):
    data = tmp_path / "pairs.tsv"
    data.write_text("a b\tx\n" * 70, encoding="utf-8")  # 6 training pairs, 64 held out
    with pytest.raises(ValueError, match=r"batch_size \(8\) exceeds the 6 training pairs"):
        train(TrainConfig(data=str(data), steps=1, batch_size=8))


@pytest.mark.parametrize("argv, message", [
    (["--model", "rnn"], "invalid choice"),
    (["--steps", "0"], "must be positive"),
    (["--dtype", "int8"], "invalid choice"),
    (["--lr", "-1"], "--lr must be positive"),
    (["--lr", "inf"], "--lr must be positive and finite"),
    (["--seed", str(2**64)], "--seed must be in [-2**63, 2**64)"),
    (["--dropout", "1.5"], "--dropout must be in [0, 1)"),
    (["--examples", "-2"], "--examples must be 0 or more"),
    (["--device", "bogus"], "--device: "),
    (["--device", "cuda:99"], "CUDA device(s)"),
])
def test_bad_arguments_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_DEADLINE_S = 240


def _one_step(rank: int, world_size: int, port: int, model: str, path: str) -> None:
    faulthandler.dump_traceback_later(_DEADLINE_S - 20, exit=True)  # a hung rank shows where, in the test's output
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_default_dtype(torch.float64)  # Adam's first step is sign-like: rounding noise must stay tiny
    torch.set_num_threads(1)
    summary = train(TrainConfig(model=model, preset="tiny", steps=1, batch_size=8, dropout=0.0, examples=0,
                                device="cpu"))
    if rank == 0:
        torch.save(summary["model"].state_dict(), path)


@pytest.mark.parametrize("model", MODELS)
def test_ddp_step_matches_one_process_on_the_whole_batch(model, tmp_path, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    processes = mp.start_processes(_one_step, args=(2, _free_port(), model, str(tmp_path / "ddp.pt")), nprocs=2,
                                   start_method="spawn", join=False)
    # A rendezvous that never completes fails here in minutes, not at gloo's 30-minute timeout.
    deadline = time.monotonic() + _DEADLINE_S
    while not processes.join(timeout=max(0.0, deadline - time.monotonic())):  # returns as each process ends
        if time.monotonic() >= deadline:
            for process in processes.processes:
                process.kill()
            pytest.fail(f"the two DDP processes did not finish within {_DEADLINE_S} s")
    ddp = torch.load(tmp_path / "ddp.pt")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        config = TrainConfig(model=model, preset="tiny", steps=1, batch_size=8, dropout=0.0, examples=0, device="cpu")
        torch.manual_seed(config.seed)  # as train() seeds before it builds the model
        initial = train_module.build_model(config, train_module.synthetic_corpus(seed=config.seed)).state_dict()
        single = train(config)["model"].state_dict()
    finally:
        torch.set_default_dtype(previous)
    assert ddp.keys() == single.keys()
    for name, value in single.items():
        torch.testing.assert_close(ddp[name], value, rtol=1e-9, atol=1e-9, msg=name)
    # The step moved the weights, so the comparison is not of two untouched models.
    assert sum(not torch.equal(single[name], initial[name]) for name in single) > len(single) // 2


def test_more_processes_than_gpus_is_named(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for name, value in dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1").items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=r"LOCAL_RANK=1, but only 1 CUDA device\(s\) are visible"):
        train(TrainConfig(model="transformer", preset="tiny", steps=1))


def test_the_group_goes_only_once_no_collective_holds_the_reduced_tensor():
    """The DDP test's hang at exit: a communication thread still holding a reduced tensor needs the
    GIL to drop it, while the group's destructor holds the GIL and waits for that thread."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        reduced = torch.zeros(1)
        dist.all_reduce(reduced)
        holder = [reduced.view(1)]  # stands for a work not yet dropped: a second reference to the tensor
        assert reduced._use_count() > 1
        threading.Timer(0.3, holder.clear).start()
        start = time.monotonic()
        train_module._leave_process_group(reduced, settle_s=0.0)
        assert time.monotonic() - start >= 0.25 and not dist.is_initialized()
    finally:
        if dist.is_initialized():  # a failure above leaves no group to later tests
            dist.destroy_process_group()
