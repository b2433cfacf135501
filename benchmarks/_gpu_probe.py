"""What machine the GPU command runs on: the device, its peak memory bandwidth, the versions of everything.

    python benchmarks/_gpu_probe.py [--json machine.json]

Prints one line per fact and writes them as JSON. The peak bandwidth is the data sheet's figure,
computed from ``torch.cuda.get_device_properties``: memory clock x 2 (double data rate) x bus
width; ``None`` where torch does not report them.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import platform
import subprocess
from typing import Any


def versions() -> dict[str, str | None]:
    """Installed versions of the packages the GPU command uses (None: not installed)."""
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("torch", "lightning", "pytest", "hypothesis", "tensorboard", "matplotlib", "jax", "jaxlib",
                 "keras", "tensorflow", "wandb", "lossscale-callbacks"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def driver() -> str | None:
    """The NVIDIA driver version from ``nvidia-smi``, when it is there."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None


def device() -> dict[str, Any]:
    """The first CUDA device as torch sees it, with its peak memory bandwidth in GB/s."""
    import torch

    if not torch.cuda.is_available():
        return {"cuda": False}
    props = torch.cuda.get_device_properties(0)
    clock_khz = getattr(props, "memory_clock_rate", 0) or 0
    bus_bits = getattr(props, "memory_bus_width", 0) or 0
    peak = 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9 if clock_khz and bus_bits else None
    return {
        "cuda": True, "name": props.name, "count": torch.cuda.device_count(),
        "capability": f"{props.major}.{props.minor}", "sms": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1), "peak_bandwidth_gbs": peak,
        "torch_cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(), "driver": driver(),
    }


def jax_backend() -> str | None:
    """JAX's default backend ("gpu" or "cpu"), which the Keras-on-JAX figures ran on."""
    try:
        jax = importlib.import_module("jax")
    except ImportError:
        return None
    return f"{jax.default_backend()} ({len(jax.devices())} device(s))"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="also write the facts here")
    args = parser.parse_args(argv)
    facts = {"device": device(), "versions": versions(), "jax_backend": jax_backend(),
             "platform": platform.platform()}
    for key, value in facts.items():
        print(f"{key}: {value}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(facts, handle, indent=2)
    return facts


if __name__ == "__main__":
    main()
