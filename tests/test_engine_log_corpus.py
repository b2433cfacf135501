"""``report`` on logs as users paste them: each excerpt of ``tests/engine_log_corpus``, as a user runs it.

Each excerpt (a real one from a public thread, or a synthetic one for a wording no thread shows, written
from the engine's source) has a sidecar with the facts a reader can see in it (see the corpus's README).
Every file goes through the command line, ``lossscale-callbacks report FILE --json`` and the text form, and
every fact of its sidecar must hold. ``held_out/`` holds excerpts that were not looked at while the reading
rules were written: the same checks, so the logs are read by rule, not by file. Runtime: a few seconds.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest

from lossscale_callbacks._cli import main

CORPUS = Path(__file__).parent / "engine_log_corpus"
HELD_OUT = CORPUS / "held_out"
_SCALES = ("first_scale", "last_scale", "min_scale_seen", "max_scale_seen")
# Sidecar facts that mean the run is in trouble: its report must never call it healthy.
_TROUBLE = ("stopped", "every_step_skipped", "at_minimum", "near_minimum", "grad_norm_nan")


def _excerpts(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir()
                  if p.suffix in (".log", ".json") and not p.name.endswith(".facts.json"))


def _facts(path: Path) -> dict:
    return json.loads(path.with_name(path.stem + ".facts.json").read_text(encoding="utf-8"))


def _report(path: Path, capsys, *extra: str) -> tuple[int, str]:
    status = main(["report", str(path), *extra])
    return status, capsys.readouterr().out


def _same_scale(got, want) -> bool:
    if isinstance(want, dict) or want is None:
        return got == want
    return isinstance(got, (int, float)) and math.isclose(got, want, rel_tol=1e-12)


def _troubled(facts: dict) -> bool:
    # A NaN gradient norm next to an engine's overflows is those overflows' (their steps were skipped).
    explained = facts["engine"] in ("apex", "deepspeed", "fairseq") and facts.get("overflows")
    return (any(facts.get(key) for key in _TROUBLE if key != "grad_norm_nan")
            or bool(facts.get("grad_norm_nan") and not explained) or bool(facts.get("nan_not_skipped")))


def _check_json(run: dict, facts: dict) -> None:
    expected_status = facts.get("status", "read")
    assert run["status"] == expected_status, run.get("reason")
    if expected_status != "read":
        reason = run["reason"]
        assert "no loss-scale line" in reason and "formats known" in reason, reason
        assert "TensorBoard" not in reason, reason
        if facts.get("unknown_lines"):
            assert f"{facts['unknown_lines']} line(s) speak of loss scaling" in reason, reason
        return
    engine = run["engine_log"]
    assert engine["engine"] == facts["engine"]
    assert set(facts["wording"]) <= set(engine["wordings"]), engine["wordings"]
    assert run["steps"] == facts["steps"], (run["steps"], engine.get("steps_at_least"))
    assert engine["steps_bound"] == facts.get("steps_bound")
    if facts["steps"] is None:
        assert run["skip_rate"] is None
    assert engine["overflows"] == facts["overflows"]
    if "skipped_steps" in facts:
        assert run["skipped_steps"] == facts["skipped_steps"]
    for key in _SCALES:
        assert _same_scale(engine[key], facts[key]), (key, engine[key], facts[key])
    assert engine["stopped"] == facts["stopped"]
    assert engine["stop_reason"] == facts["stop_reason"]
    assert bool(engine["grad_norm_nan"]) == facts["grad_norm_nan"]
    for key in ("every_step_skipped", "at_minimum", "near_minimum"):
        assert engine[key] == facts.get(key, False), key
    assert engine["nan_not_skipped"] == facts.get("nan_not_skipped", 0)
    # the run's range holds every scale printed (and the levels known between them: a halving's start)
    if isinstance(facts["min_scale_seen"], float):
        assert run["min_scale_seen"] <= facts["min_scale_seen"] * (1 + 1e-12), run["min_scale_seen"]
    if isinstance(facts["max_scale_seen"], float):
        assert run["max_scale_seen"] >= facts["max_scale_seen"] * (1 - 1e-12), run["max_scale_seen"]
    if _troubled(facts):
        assert not run["healthy"], run["summary"]
        assert "no problem" not in run["summary"].split("Health:")[-1].split("\n")[0], run["summary"]


def _check_text(text: str, facts: dict) -> None:
    if facts.get("status", "read") != "read":
        return
    assert "\\n" not in text, text  # one problem a line, not an escaped line break
    if facts["steps"] is None:
        assert "Optimizer steps attempted: not known" in text, text
    if facts["stop_reason"]:
        assert facts["stop_reason"] in text, text
    if facts.get("every_step_skipped"):
        assert re.search(r"every one of the \d+ steps seen was skipped", text, re.IGNORECASE), text
    if facts.get("nan_not_skipped"):
        assert (f"{facts['nan_not_skipped']} iteration(s) with a NaN gradient norm were not skipped: their "
                "updates were applied") in text, text
    if facts.get("at_minimum"):
        at_min = next((line for line in text.splitlines() if line.startswith("Steps at the minimum")), "")
        assert "none seen" not in at_min, text
    if _troubled(facts):
        health = next(line for line in text.splitlines() if line.startswith("Health:"))
        assert "no problem" not in health, health


def _check(path: Path, capsys) -> None:
    facts = _facts(path)
    status, out = _report(path, capsys, "--json")
    payload = json.loads(out)
    (run,) = payload["runs"]
    _check_json(run, facts)
    assert status == (0 if facts.get("status", "read") == "read" else 2)
    _, text = _report(path, capsys)
    _check_text(text, facts)


@pytest.mark.parametrize("path", _excerpts(CORPUS), ids=lambda p: p.name)
def test_every_fact_of_every_excerpt_holds(path, capsys):
    _check(path, capsys)


@pytest.mark.parametrize("path", _excerpts(HELD_OUT), ids=lambda p: f"held_out/{p.name}")
def test_held_out_excerpts_are_read_by_rule(path, capsys):
    _check(path, capsys)


def test_the_corpus_is_what_the_issue_asks_for():
    """At least 40 real excerpts, from at least 6 engines or families, each citing its thread; every
    engine that changed its wording shows two wordings or more."""
    real = [_facts(p) for p in _excerpts(CORPUS) if not _facts(p).get("synthetic")]
    assert len(real) >= 40
    assert all(f["source"].startswith("https://github.com/") for f in real)
    families = {f["source"].split("/")[3] + "/" + f["source"].split("/")[4] for f in real}
    assert len({f["engine"] for f in real}) >= 5 and len(families) >= 6
    every = [_facts(p) for p in _excerpts(CORPUS)]
    for engine in ("deepspeed", "apex", "fairseq", "megatron", "transformers"):
        wordings = {w for f in every if f["engine"] == engine for w in f["wording"]
                    if not w.startswith("counter.")}
        assert len(wordings) >= 2, engine
    synthetic = [f for f in every if f.get("synthetic")]
    assert all(f["source_file"] and f["tag"] for f in synthetic)
    # every wording of the table, each engine's over its releases, is in an excerpt (real or synthetic)
    from lossscale_callbacks.report._engine_formats import WORDINGS

    shown = {w for f in every for w in f["wording"]}
    assert {w.id for w in WORDINGS if w.engine != "any"} <= shown


def test_the_table_never_calls_a_run_in_trouble_healthy(capsys):
    """A folder of these logs gives a table; a run in trouble never reads "no problem" or "OK" there."""
    main(["report", str(CORPUS)])
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[2:] if line.strip()}
    troubled = [p.name for p in _excerpts(CORPUS) if _troubled(_facts(p))]
    assert troubled
    for name in troubled:
        row = rows[name]
        assert "no problem" not in row and not row.rstrip().endswith("OK"), row


def test_every_excerpt_is_found_in_a_folder():
    """Discovery by content finds every excerpt a report reads (the folder walk opens each file)."""
    from lossscale_callbacks.report._run_readers import discover_runs

    found = {os.path.basename(run.path) for run in discover_runs(str(CORPUS))}
    for path in _excerpts(CORPUS):
        if _facts(path).get("status", "read") == "read":
            assert path.name in found, path.name


def test_the_table_says_what_is_not_known(capsys):
    """A log without a step counter: the steps a lower bound (≥N) and no skip rate; a log without a scale:
    no final scale; and the health column says the run could not be judged rather than "OK"."""
    main(["report", str(CORPUS)])
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[2:] if line}
    for path in _excerpts(CORPUS):
        facts = _facts(path)
        if facts.get("status", "read") != "read":
            continue
        _, steps, _, rate, final, *health = rows[path.name]
        if facts["steps"] is None:
            assert steps.startswith("≥") and rate == "-", rows[path.name]
            assert " ".join(health) != "OK", rows[path.name]
        else:
            assert steps == str(facts["steps"]), rows[path.name]
        if facts["last_scale"] is None:
            assert final == "-", rows[path.name]


@pytest.mark.parametrize("name", ["transformers_ModernBERT_233.log", "deepspeed_DeepSpeed_5779.log",
                                  "deepspeed_Chinese-LLaMA-Alpaca_534_3.log", "fairseq_fairseq_1529.log"])
def test_a_picture_is_drawn_when_steps_or_scale_are_not_known(name, tmp_path, capsys):
    """No scale in the log: the picture says so (no placeholder line); no step counter: the step axis
    says its steps are a lower bound; levels printed between log points are drawn."""
    pytest.importorskip("matplotlib")
    picture = tmp_path / "p.png"
    assert main(["report", str(CORPUS / name), "--png", str(picture)]) == 0
    assert picture.stat().st_size > 0


# ----------------------------------------
# One test for each item of issue 37's list, each from a real excerpt of the corpus (the Trainer state's
# from a synthetic one: no thread shows a stock trainer_state.json). Each failed on the code before it.


def _json(name: str, capsys) -> dict:
    main(["report", str(CORPUS / name), "--json"])
    (run,) = json.loads(capsys.readouterr().out)["runs"]
    return run


def _text(name: str, capsys) -> str:
    main(["report", str(CORPUS / name)])
    return capsys.readouterr().out


@pytest.mark.parametrize(("name", "overflows"), [
    ("fairseq_fairseq_512.log", 12),  # | WARNING: overflow detected, setting loss scale to: ... (v0.5-v0.9)
    ("fairseq_fairseq_2404.log", 1),  # NOTE: overflow detected, setting loss scale to: 1024.0 (2020)
    ("deepspeed_DeepSpeed_386.log", 8),  # [deepscale] OVERFLOW! Rank 0 ... (stage2.py): those lines only
])
def test_older_wordings_are_read(name, overflows, capsys):
    run = _json(name, capsys)
    assert run["status"] == "read", run.get("reason")
    assert "in a format this reader does not know" not in run["summary"], run["summary"]
    assert run["skipped_steps"] >= overflows, run["summary"]


def test_a_message_after_a_progress_bar_and_glued_messages_are_read(capsys):
    """transformers#9996: tqdm's bar, then the DeepSpeed message on the same line, the bar's 6/1184 the
    steps; DeepLearningExamples#1107: apex's messages two to a line."""
    run = _json("deepspeed_transformers_9996.log", capsys)
    assert run["status"] == "read", run.get("reason")
    assert (run["steps"], run["skipped_steps"]) == (9, 3)
    assert _json("apex_DeepLearningExamples_1107_2.log", capsys)["skipped_steps"] == 5


def test_a_run_that_died_is_never_called_healthy(capsys):
    """fairseq#512 (twelve overflows down to 0.000122) and the engine's own fatal message (fairseq#2640)."""
    run = _json("fairseq_fairseq_512.log", capsys)
    assert not run["healthy"] and run["skipped_steps"] == 12
    assert run["final_scale"] == 0.0001220703125
    run = _json("fairseq_fairseq_2640.log", capsys)
    assert not run["healthy"]
    assert run["verdicts"][0]["rule"] == "engine_stopped"
    assert "Minimum loss scale reached" in run["verdicts"][0]["message"]


@pytest.mark.parametrize(("name", "seen"), [("deepspeed_DeepSpeed_386.log", 8),
                                            ("apex_DeepLearningExamples_1107_2.log", 5),
                                            ("deepspeed_DeepSpeed_931.log", 4)])
def test_every_step_seen_skipped_is_said(name, seen, capsys):
    text = _text(name, capsys)
    assert f"Every one of the {seen} steps seen was skipped" in text, text
    assert "no problem" not in text


def test_a_run_stuck_at_the_minimum_is_read_and_said(capsys):
    """transformers#14531: DeepSpeed at a scale of 1, overflowing every step."""
    run = _json("deepspeed_transformers_14531.log", capsys)
    assert run["status"] == "read" and not run["healthy"]
    assert "stuck_at_minimum" in {v["rule"] for v in run["verdicts"]}


def test_steps_a_log_does_not_hold_are_not_invented(capsys):
    """DeepSpeed#5779: no step counter: steps null, no skip rate; fairseq#1529: "loss_scale 0.000"."""
    run = _json("deepspeed_DeepSpeed_5779.log", capsys)
    assert run["steps"] is None and run["skip_rate"] is None
    assert "Optimizer steps attempted: not known" in run["summary"]
    run = _json("fairseq_fairseq_1529.log", capsys)
    assert run["status"] == "read" and run["engine_log"]["last_scale"] == {"below": 0.0005}


def test_every_printed_level_is_in_the_series(capsys):
    """Chinese-LLaMA-Alpaca#534: 64 -> 2 in five overflows between two bar updates; DeepSpeed#5779:
    65536 -> 512 one halving at a time."""
    run = _json("deepspeed_Chinese-LLaMA-Alpaca_534_3.log", capsys)
    assert (run["min_scale_seen"], run["max_scale_seen"]) == (2.0, 64.0)
    assert {scale for _, scale in run["series"]["loss_scale/levels"]} == {64.0, 32.0, 16.0, 8.0, 4.0, 2.0}
    run = _json("deepspeed_DeepSpeed_5779.log", capsys)
    assert {2.0**k for k in range(9, 17)} <= {scale for _, scale in run["series"]["loss_scale/levels"]}


def test_nan_gradient_norms_not_skipped_are_said(capsys):
    """Megatron-DeepSpeed#396: bf16, "grad norm: nan" on every line, "number of skipped iterations: 0"."""
    run = _json("megatron_Megatron-DeepSpeed_396.log", capsys)
    assert not run["healthy"]
    assert ("3 iteration(s) with a NaN gradient norm were not skipped: their updates were applied"
            in run["summary"])


def test_the_stock_trainer_state_is_read(capsys):
    run = _json("transformers_synthetic_trainer_state_logging1.json", capsys)
    assert run["status"] == "read" and (run["steps"], run["skipped_steps"]) == (12, 3)
    assert "inferred" in run["summary"]


def test_a_text_file_without_a_loss_scale_says_what_it_is(capsys):
    """Chinese-LLaMA-Alpaca#534: a Trainer console with no loss-scale line."""
    run = _json("transformers_Chinese-LLaMA-Alpaca_534_2.log", capsys)
    assert run["status"] == "no_loss_scale"
    assert "no loss-scale lines in 22 lines (formats known: DeepSpeed" in run["reason"]
    assert "TensorBoard" not in run["reason"]
