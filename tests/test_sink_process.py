"""The sinks' process helpers: the rank of this process, and the core's report/CLI staying framework-free."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lossscale_callbacks._ranks import process_rank
from lossscale_callbacks._sinks import InMemorySink, ManagedSink, SinkFailureWarning

RANK_VARS = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "JSM_NAMESPACE_RANK",
             "LOCAL_RANK", "TF_CONFIG")


@pytest.fixture
def clean_env(monkeypatch):
    for var in RANK_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.mark.parametrize("env, rank", [
    ({}, 0),
    ({"RANK": "2", "LOCAL_RANK": "0"}, 2),
    ({"LOCAL_RANK": "1"}, 1),
    ({"SLURM_PROCID": "5"}, 5),
    ({"OMPI_COMM_WORLD_RANK": "3"}, 3),
    ({"TF_CONFIG": json.dumps({"cluster": {"worker": ["a", "b"]}, "task": {"type": "worker", "index": 0}})},
     0),
    ({"TF_CONFIG": json.dumps({"cluster": {"worker": ["a", "b"]}, "task": {"type": "worker", "index": 1}})},
     1),
    ({"TF_CONFIG": json.dumps({"cluster": {"chief": ["c"], "worker": ["a"]},
                               "task": {"type": "worker", "index": 0}})}, 1),
    ({"TF_CONFIG": json.dumps({"cluster": {"chief": ["c"]}, "task": {"type": "chief", "index": 0}})}, 0),
    ({"TF_CONFIG": json.dumps({"task": {"type": "evaluator", "index": 0}})}, 1),
    ({"TF_CONFIG": "not json"}, 0),
])
def test_process_rank_from_the_environment(clean_env, env, rank):
    for var, value in env.items():
        clean_env.setenv(var, value)
    assert process_rank() == rank


def test_an_initialised_torch_process_group_wins(clean_env):
    import torch.distributed as dist

    clean_env.setenv("RANK", "7")
    clean_env.setattr(dist, "is_initialized", lambda: True)
    clean_env.setattr(dist, "get_rank", lambda group=None: 3)
    assert process_rank() == 3


def test_managed_sink_writes_on_rank_zero_only(clean_env):
    memory = InMemorySink()
    clean_env.setenv("RANK", "1")
    sink = ManagedSink(memory, name="memory")
    sink.write(1, {"loss_scale/scale": 2.0})
    assert memory.records == [] and not sink.active
    everywhere = ManagedSink(memory, name="memory", all_ranks=True)
    everywhere.write(1, {"loss_scale/scale": 2.0})
    everywhere.close()
    assert memory.records == [(1, {"loss_scale/scale": 2.0})] and memory.closed


def test_a_disabled_sink_still_closes_its_backend_quietly(clean_env):
    class Failing(InMemorySink):
        def write(self, step, metrics):
            raise OSError(28, "No space left on device")

    backend = Failing()
    sink = ManagedSink(backend, name="failing")
    with pytest.warns(SinkFailureWarning) as caught:
        sink.write(1, {"loss_scale/scale": 2.0})
        sink.write(2, {"loss_scale/scale": 2.0})
        sink.close()  # the file/run the backend holds is released; no second warning
    assert len(caught) == 1 and sink.disabled and backend.closed


def test_the_core_report_and_cli_import_no_framework_or_dashboard_package():
    code = (
        "import sys\n"
        "import lossscale_callbacks._cli, lossscale_callbacks.report._report_cli\n"
        "import lossscale_callbacks.report._run_report, lossscale_callbacks.report._run_readers\n"
        "import lossscale_callbacks._ranks, lossscale_callbacks._sinks, lossscale_callbacks._sinks\n"
        "heavy = ('tensorflow', 'torch', 'keras', 'lightning', 'pytorch_lightning', 'wandb', 'tensorboard',"
        " 'matplotlib')\n"
        "print(sorted({k.split('.')[0] for k in sys.modules} & set(heavy)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
