"""The ledger of bad steps on a plain torch loop: the acceptance scenario, replay, bit-identity, host reads.

The scenario (``ledger_scenario``): 512 samples, 37 and 301 overflow ``fc2`` in float16 (finite in
float32), batch 8 shuffled with seed 0, 3 epochs, an Inf written into a gradient at step 50 (a clean
batch). The ledger must hold exactly the steps whose batch holds 37 or 301, each blaming its sample and
naming ``fc2``, replayed as reproducible at any scale and finite in float32, and step 50 as transient.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import ledger_scenario as sc  # noqa: E402
from aten_ops import AtenOps  # noqa: E402

from lossscale_callbacks import DynamicPolicy, LoggingLoop  # noqa: E402
from lossscale_callbacks.ledger._read import ledger_markdown, read_ledgers  # noqa: E402
from lossscale_callbacks.ledger._skip import SKIP_BATCHES, SKIP_SAMPLES, skip_samples, write_skip_list  # noqa: E402
from lossscale_callbacks.torch import LossScaler  # noqa: E402


def _run(folder: Any = None, *, replay: Any = True, track: bool = True, skip: Any = None,
         log_every: int = 10, fused: bool = False) -> dict[str, Any]:
    """The scenario's plain loop; each interval's bad steps come from the skip truth (``read_outcomes``)."""
    torch.manual_seed(0)
    model = sc.Net()
    loader = sc.loader(sc.dataset(), wrap=None if skip is None else (lambda s: skip_samples(s, skip)))
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True) if fused
           else torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9))
    scaler = LossScaler(policy=DynamicPolicy(initial_scale=1024.0, growth_interval=10_000)).watch(model)
    if track:
        loader = scaler.track(loader, ledger=folder, replay=replay,
                              loss=lambda batch: sc.loss_fn(model, batch))
    loop = LoggingLoop(scaler.policy, log_every=log_every, tensorboard=folder, echo=None) if folder else None
    step = 0
    for _ in range(sc.EPOCHS):
        for batch in loader:
            step += 1
            with torch.autocast("cpu", dtype=torch.float16):
                loss = sc.loss_fn(model, batch)
            scaler.scale(loss).backward()
            if step == sc.INJECT_AT:
                model.fc1.weight.grad[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            if track and step % log_every == 0:
                scaler.read_outcomes()  # the skip truth, read at the interval: the ledger takes its bad steps
            if loop is not None:
                loop.maybe_observe(step, scaler.get_state)
    if loop is not None:
        loop.finish(scaler.get_state())
    book = scaler.ledger if track else None
    if book is not None:
        book.close()
    return {"model": model, "opt": opt, "book": book, "steps": step, "rng": torch.get_rng_state(),
            "scaler": scaler}


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    folder = tmp_path_factory.mktemp("run")
    return folder, _run(folder)


def test_the_ledger_holds_exactly_the_bad_samples_steps_and_the_injected_one(replayed):
    _, run = replayed
    expected = sc.expected_bad_steps(sc.shuffled_orders())
    assert len(expected) == 6
    assert sc.INJECT_AT not in expected
    entries = {e.step: e for e in run["book"].entries}
    assert sorted(entries) == sorted([*expected, sc.INJECT_AT])
    for step, sample in expected.items():
        entry = entries[step]
        assert sample in entry.samples()
        assert entry.culprits() == (sample,)
        assert entry.producing_layer == "fc2"
        assert entry.verdict == "float16_range"
        assert entry.replay.same is False and entry.replay.low is False and entry.replay.float32 is True
    assert entries[sc.INJECT_AT].verdict == "transient"
    assert entries[sc.INJECT_AT].culprits() == ()


def test_the_ledger_file_is_read_back_and_its_words_name_sample_and_layer(replayed):
    folder, run = replayed
    back = read_ledgers(folder)
    assert [e.to_json() for e in back] == [e.to_json() for e in run["book"].entries]
    words = " ".join(run["book"].sentences())
    assert ("overflowed on sample 37 at any scale; finite in float32: layer `fc2` exceeds float16 on this "
            "sample") in words
    assert f"Step {sc.INJECT_AT} replayed finite at the same scale" in words


def test_report_lists_the_bad_samples_beside_the_run_and_writes_the_skip_list(replayed, tmp_path):
    folder, _ = replayed
    cli = [sys.executable, "-m", "lossscale_callbacks._cli", "report", str(folder)]
    done = subprocess.run([*cli, "--skip-list", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Ledger of bad steps:" in done.stdout
    assert "| 37 | 34, 74 and 165 | 0 | at any scale, finite in float32 | `fc2` |" in done.stdout
    assert "| 301 | 15, 92 and 175 | 0 |" in done.stdout
    assert json.loads((tmp_path / SKIP_SAMPLES).read_text())["samples"] == [37, 301]
    as_json = subprocess.run([*cli, "--json"], capture_output=True, text=True, timeout=120)
    run = json.loads(as_json.stdout)["runs"][0]
    assert [b["sample"] for b in run["ledger"]["bad_samples"]] == [301, 37]
    assert len(run["ledger"]["entries"]) == 7


def test_replay_leaves_the_run_bit_identical():
    plain = _run(track=False)
    replayed = _run(replay=True)
    assert plain["steps"] == replayed["steps"]
    for (name, a), b in zip(plain["model"].state_dict().items(), replayed["model"].state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), name
    state_a, state_b = plain["opt"].state_dict()["state"], replayed["opt"].state_dict()["state"]
    for key in state_a:
        for field in state_a[key]:
            assert torch.equal(torch.as_tensor(state_a[key][field]), torch.as_tensor(state_b[key][field]))
    assert torch.equal(plain["rng"], replayed["rng"])
    assert plain["scaler"].get_state() == replayed["scaler"].get_state()


def test_a_run_resumed_with_the_skip_list_has_no_bad_step_from_those_samples(replayed, tmp_path):
    _, run = replayed
    samples_path, batches_path = write_skip_list(run["book"].entries, tmp_path)
    listed = json.loads(samples_path.read_text())
    assert listed["samples"] == [37, 301]
    assert samples_path.name == SKIP_SAMPLES and batches_path.name == SKIP_BATCHES
    assert json.loads(batches_path.read_text()) == sorted({(s - 1) % 64 for s in listed["steps"]})
    again = _run(skip=samples_path)
    assert again["steps"] == 3 * 64  # 510 samples: 63 full batches and one of 6, each epoch
    for entry in again["book"].entries:
        assert not set(entry.samples()) & set(sc.BAD)
        assert entry.verdict == "transient"


def test_the_budget_bounds_replays_per_interval():
    run = _run(replay=1, log_every=192)  # one interval for the whole run: one replay
    entries = run["book"].entries
    assert sum(e.replay is not None for e in entries) == 1
    assert all(e.replay_note.startswith("budget") for e in entries if e.replay is None)


def _step_reads(scaler: LossScaler, model: torch.nn.Module, opt: Any, loader: Any) -> list[str]:
    """Aten ops of host reads (``_local_scalar_dense``, what ``item``/``bool`` dispatch) in an ordinary
    step, loader included."""
    batches = iter(loader)
    for _ in range(3):
        batch = next(batches)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = sc.loss_fn(model, batch)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    with AtenOps() as ops:
        batch = next(batches)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = sc.loss_fn(model, batch)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return [n for n in ops.names if n in ("_local_scalar_dense", "item")]


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("mode", ["off", "ledger", "replay"])
def test_host_reads_added_by_the_ledger(fused, mode):
    """The ledger adds no host read to an ordinary step; replay neither with a non-fused optimizer (its
    step reads the skip decision anyway), and one (the step's flag) with a fused one."""
    torch.manual_seed(0)
    model = sc.Net()
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True) if fused
           else torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9))
    scaler = LossScaler(policy=DynamicPolicy(initial_scale=1024.0)).watch(model)
    data = torch.utils.data.Subset(sc.dataset(), [i for i in range(sc.N) if i not in sc.BAD])
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)
    if mode != "off":
        loader = scaler.track(loader, replay=mode == "replay", loss=lambda b: sc.loss_fn(model, b))
    reads = _step_reads(scaler, model, opt, loader)
    baseline = 0 if fused else 1  # a non-fused step reads found_inf once, as GradScaler does
    added = 1 if (fused and mode == "replay") else 0
    assert len(reads) == baseline + added, reads


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    script = os.path.join(os.path.dirname(__file__), "ledger_scripts", "ddp_ledger.py")
    proc = subprocess.run([sys.executable, script, str(out)], env=dict(os.environ, CUDA_VISIBLE_DEVICES=""),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_two_gloo_ranks_write_each_their_own_entries_with_their_own_samples(two_ranks):
    entries = read_ledgers(two_ranks)
    runs = [json.loads((two_ranks / f"order_rank{rank}.json").read_text()) for rank in range(2)]
    batches = {}  # (rank, step) -> the rank's batch at that step
    for rank, run in enumerate(runs):
        for epoch, order in enumerate(run["orders"]):
            for b in range(0, len(order), sc.BATCH):
                batches[(rank, epoch * (len(order) // sc.BATCH) + b // sc.BATCH + 1)] = order[b:b + sc.BATCH]
    blamed = {step: sorted(set(batch) & set(sc.BAD)) for (rank, step), batch in batches.items()
              if set(batch) & set(sc.BAD)}
    assert not any(set(batches[(r, sc.INJECT_AT)]) & set(sc.BAD) for r in range(2))
    steps = sorted({*blamed, sc.INJECT_AT})
    assert sorted((e.step, e.rank) for e in entries) == [(s, r) for s in steps for r in range(2)]
    for entry in entries:
        assert list(entry.samples()) == batches[(entry.rank, entry.step)]  # its own samples, in order
        mine = sorted(set(entry.samples()) & set(sc.BAD))
        if entry.step == sc.INJECT_AT:
            assert entry.verdict == "transient"
        elif mine:
            assert entry.verdict == "float16_range" and sorted(entry.culprits()) == mine
            assert entry.producing_layer == "fc2"
        else:
            assert entry.verdict == "other_rank" and entry.replay.other_ranks == (1 - entry.rank,)
    table = ledger_markdown(entries)
    assert "| 37 |" in table and "| 301 |" in table
