
from repo_scripts import load_script


def test_core_simulation_example_prints_the_trajectory(capsys):
    module = load_script("examples/core_simulation.py")
    sink = module.main(steps=1000, log_every=100)
    out = capsys.readouterr().out
    scales = [value for _, value in sink.series("loss_scale/scale")]
    assert len(scales) == 10 and scales[0] < 2.0**15  # settled down from the initial scale
    assert "Loss scaling: 1000 optimizer steps" in out
    assert out.count("\n") >= 12
